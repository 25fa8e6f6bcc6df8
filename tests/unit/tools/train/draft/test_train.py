"""`avspec.tools.train.draft.train` and `model`: the distillation loss (over the whole vocabulary
and over a reduced one), the answer positions it scores, the two draft shapes (a fresh one with the
target's SVD embedding; the target's own layers over its frozen embedding), and the prompts it
trains on."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P
from avspec.tools.train.draft.model import new_draft, skeleton, svd_embedding, target_layers_draft
from avspec.tools.train.draft.prompts import KINDS, build_prompts
from avspec.tools.train.draft.train import answer_logits, kept_slots, top_kl, top_tv
from avspec.tools.train.tiny.corpus import TOPICS_PREFIX
from avspec.tools.train.tiny.evaluate import warp

CONFIG = TransformerConfig(
    num_layers=1, width=32, num_heads=2, vocab_size=40, max_length=64, mlp="swiglu", norm_eps=1e-5
)


def test_top_kl_is_zero_only_for_the_teacher():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(6, 40, generator=gen) * 3
    values, ids = teacher.topk(8, dim=-1)
    exact = torch.full_like(teacher, -1e9).scatter(-1, ids, values)
    assert top_kl(exact, ids, values).abs() < 1e-5
    assert top_kl(teacher, ids, values) > 1e-3  # mass outside the top 8 is penalised
    assert top_kl(torch.randn(6, 40, generator=gen), ids, values) > 0.1


def test_top_tv_is_one_minus_the_served_acceptance():
    """Against `warp` (the served warp, also the report's), p from the teacher's top 8; ids -1
    are dropped. A variant warping at temperature 1 differs, so the temperature is checked."""
    gen = torch.Generator().manual_seed(1)
    teacher = torch.randn(6, 40, generator=gen) * 3
    draft = torch.randn(6, 40, generator=gen) * 2
    values, ids = teacher.topk(8, dim=-1)
    p = warp(torch.full_like(teacher, float("-inf")).scatter(-1, ids, values), TEMPERATURE, TOP_P)
    accept = torch.minimum(p, warp(draft, TEMPERATURE, TOP_P)).sum(-1).mean()
    assert top_tv(draft, ids, values).item() == pytest.approx(1 - accept.item(), abs=1e-6)
    assert abs(top_tv(draft, ids, values, temperature=1.0).item() - (1 - accept.item())) > 1e-3
    exact = torch.full_like(teacher, -1e9).scatter(-1, ids, values)
    assert top_tv(exact, ids, values).abs() < 1e-5
    dropped = ids.clone()
    dropped[0] = -1  # a position with no kept teacher id is left out
    rest = top_tv(draft[1:], ids[1:], values[1:])
    assert top_tv(draft, dropped, values).item() == pytest.approx(rest.item(), abs=1e-6)


def test_top_tv_gradient_raises_the_acceptance():
    """From a random draft (acceptance 0.07) plain gradient steps on top_tv reach 0.6: not 1,
    since ids outside q's nucleus get no gradient (training adds it to the KL, which reaches
    them)."""
    gen = torch.Generator().manual_seed(2)
    values, ids = (torch.randn(4, 40, generator=gen) * 3).topk(8, dim=-1)
    draft = torch.randn(4, 40, generator=gen).requires_grad_()
    before = top_tv(draft, ids, values).item()
    optimizer = torch.optim.SGD([draft], lr=20.0)
    for _ in range(100):
        optimizer.zero_grad()
        top_tv(draft, ids, values).backward()
        optimizer.step()
    assert before > 0.9 and top_tv(draft, ids, values).item() < 0.5


def test_answer_logits_are_the_dense_logits_at_answer_positions():
    model = Transformer(CONFIG).eval()
    seqs = [
        {"ids": torch.tensor([1, 2, 3, 4, 5]), "prompt_length": 3, "answer_length": 3},
        {"ids": torch.tensor([6, 7, 8]), "prompt_length": 2, "answer_length": 2},
    ]
    with torch.no_grad():
        logits, _ = answer_logits(model, seqs)
        dense = [model(s["ids"][None])[0] for s in seqs]
    expected = torch.cat([dense[0][2:5], dense[1][1:3]])
    assert torch.allclose(logits, expected, atol=1e-5)


def test_svd_embedding_keeps_inner_products():
    target = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))
    full = svd_embedding(target, 16)
    assert torch.allclose(full @ full.T, target @ target.T, atol=1e-3)
    part = svd_embedding(target, 4)
    assert part.shape == (40, 4)
    # the best rank-4 approximation of the Gram matrix: better than any 4 raw columns
    err_svd = (part @ part.T - target @ target.T).norm()
    err_cols = (target[:, :4] @ target[:, :4].T - target @ target.T).norm()
    assert err_svd < err_cols


def test_prompts_cycle_kinds_and_are_reproducible():
    code = "def add(a, b):\n    '''Add two numbers and return their sum.'''\n    return a + b\n"
    prose = (
        "The while statement\n\nThe while statement is used for repeated execution as long as an "
        "expression is true. It tests the expression and, if it is true, executes the first "
        "suite; if the expression is false the loop terminates and the else clause runs.\n"
    )
    files = [("m.py", code), (TOPICS_PREFIX + "while", prose)]
    prompts = build_prompts(files, 12, seed=3)
    assert [p.kind for p in prompts] == list(KINDS) * 2
    assert prompts == build_prompts(files, 12, seed=3)
    assert "Write a Python function `add`: Add two numbers" in prompts[1].message
    assert all(p.source in {"m.py", TOPICS_PREFIX + "while"} for p in prompts)


TARGET = TransformerConfig(
    num_layers=4, width=32, num_heads=2, num_kv_heads=1, vocab_size=40, max_length=64,
    mlp="swiglu", norm_eps=1e-5,
)  # fmt: skip


def _target() -> Transformer:
    model = Transformer(TARGET)
    init_weights(model, torch.Generator().manual_seed(3))
    return model.eval()


def test_a_target_layers_draft_is_those_blocks_over_the_frozen_embedding():
    target = _target()
    draft = target_layers_draft(target, [0, 2])
    assert draft.config.num_layers == 2 and draft.config.width == TARGET.width
    assert torch.equal(draft.embed.weight, target.embed.weight)
    assert not draft.embed.weight.requires_grad
    for mine, theirs in zip(draft.blocks, [target.blocks[0], target.blocks[2]], strict=True):
        for (name, a), (_, b) in zip(
            mine.state_dict().items(), theirs.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), name
    # all four layers in order: the target itself
    ids = torch.tensor([[1, 5, 7, 2, 9]])
    whole = target_layers_draft(target, range(4)).eval()
    with torch.no_grad():
        assert torch.allclose(whole(ids), target(ids), atol=1e-6)
    assert skeleton(TARGET, {"target_layers": [0, 2]}).embed.weight.requires_grad is False


def test_target_layers_out_of_range_are_refused():
    with pytest.raises(ValueError, match="layers 0..3"):
        target_layers_draft(_target(), [0, 4])
    with pytest.raises(ValueError, match="layers"):
        target_layers_draft(_target(), [])


def test_the_fresh_shape_is_still_built():
    config = dataclasses.replace(TARGET, width=256, num_heads=4, num_kv_heads=2, vocab_size=300)
    wide = Transformer(config)
    draft = new_draft(wide, {"width": 128, "layers": 1})
    assert draft.config.width == 128 and draft.config.num_heads == 2
    assert draft.embed.weight.requires_grad


def test_kept_logits_are_the_dense_logits_of_the_kept_rows():
    model = Transformer(CONFIG).eval()
    seqs = [{"ids": torch.tensor([1, 2, 3, 4, 5]), "prompt_length": 3, "answer_length": 3}]
    rows = torch.tensor([0, 3, 17, 39])
    with torch.no_grad():
        full, _ = answer_logits(model, seqs)
        kept, _ = answer_logits(model, seqs, rows)
    assert torch.allclose(kept, full[:, rows], atol=1e-5)


def test_top_kl_over_a_reduced_vocabulary_drops_the_teacher_outside_it():
    gen = torch.Generator().manual_seed(2)
    teacher = torch.randn(5, 40, generator=gen) * 3
    values, ids = teacher.topk(8, dim=-1)
    kept = torch.arange(0, 40, 2)  # even ids only
    slots = kept_slots(kept, 40)
    assert slots[4] == 2 and slots[5] == -1
    mapped = slots[ids]
    # q over the kept ids equal to the teacher renormalised over its kept top ids: KL 0
    exact = torch.full((5, len(kept)), -1e9)
    for row, col in (mapped >= 0).nonzero().tolist():
        exact[row, mapped[row, col]] = values[row, col]
    assert top_kl(exact, mapped, values).abs() < 1e-5
    # the same q scored with the dropped ids kept in (as if mapped to slot 0): not 0
    assert top_kl(exact, mapped.clamp(min=0), values) > 1e-2
    # a position whose teacher ids all fall outside is skipped: loss and gradient finite
    mapped[0] = -1
    logits = exact.clone().requires_grad_(True)
    loss = top_kl(logits, mapped, values)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logits.grad).all()
    assert logits.grad[0].abs().sum() == 0  # the skipped position gets no gradient
    # the broken variant (the whole row kept to the end, discarded by a `where`): NaN gradient
    keep = mapped >= 0
    logits = exact.clone().requires_grad_(True)
    log_p = torch.log_softmax(values.masked_fill(~keep, float("-inf")), dim=-1)
    log_q = torch.log_softmax(logits, dim=-1).gather(-1, mapped.clamp(min=0))
    broken = torch.where(keep, log_p.exp() * (log_p - log_q), 0.0).sum(-1)[keep.any(-1)].mean()
    broken.backward()
    assert torch.isnan(logits.grad).any()


class _Process:
    def __init__(self, alive: bool, exitcode: int | None = None) -> None:
        self.alive, self.exitcode, self.terminated = alive, exitcode, False

    def is_alive(self) -> bool:
        return self.alive

    def terminate(self) -> None:
        self.terminated, self.alive, self.exitcode = True, False, -15

    def join(self) -> None:
        pass


def test_training_waits_for_a_chunk_and_not_for_a_dead_data_phase(tmp_path):
    from avspec.tools.train.draft.__main__ import _wait_for_chunk

    with pytest.raises(SystemExit, match="without a chunk"):
        _wait_for_chunk(tmp_path, _Process(alive=False))
    (tmp_path / "chunk_00000.pt").write_bytes(b"")
    _wait_for_chunk(tmp_path, _Process(alive=False))  # a chunk is there: no wait, no error


def test_a_resumed_run_refuses_another_draft_vocabulary(tmp_path, monkeypatch):
    from avspec.engine.draft_vocab import DraftVocab
    from avspec.tools.train.draft import train as train_module

    target = _target()
    monkeypatch.setattr(train_module, "load_model", lambda *a, **k: target)
    state = {
        "elapsed": 0.0, "step": 0, "seen": 0, "shape": {"target_layers": [0]},
        "kept_ids": torch.tensor([0, 1, 2]),
        "model": target_layers_draft(target, [0]).state_dict(),
    }  # fmt: skip
    torch.save(state, tmp_path / train_module.CHECKPOINT)
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train_module.train_draft(
            "unused", tmp_path, train_module.DraftTraining(1.0), vocab=DraftVocab.of([0, 1, 3], 40)
        )
    with pytest.raises(ValueError, match="another draft vocabulary"):
        train_module.train_draft("unused", tmp_path, train_module.DraftTraining(1.0), vocab=None)


def test_raw_prompts_alternate_code_and_prose_prefixes():
    from avspec.tools.train.draft.prompts import RAW_KINDS, build_raw_prompts

    code = "".join(f"def f{i}(a, b):\n    return a + {i} * b\n\n" for i in range(30))
    prose = "The while statement\n\n" + " ".join(
        f"Sentence {i} says the loop runs while the test holds, then stops." for i in range(30)
    )
    files = [("m.py", code), (TOPICS_PREFIX + "while", prose)]
    prompts = build_raw_prompts(files, 8)
    assert [p.kind for p in prompts] == list(RAW_KINDS) * 4
    assert prompts == build_raw_prompts(files, 8)
    for p in prompts:
        assert 64 <= len(p.message.encode()) <= 200
        assert (p.message in code) if p.kind == "raw_code" else ("Sentence" in p.message)


def test_a_raw_prompt_renders_without_the_chat_template():
    from avspec.tools.train.draft.generate import MAX_PROMPT_TOKENS, render
    from avspec.tools.train.draft.prompts import ChatPrompt

    class Tokenizer:  # the `transformers` calls render makes
        def __call__(self, text, add_special_tokens=True):
            assert add_special_tokens is False
            return {"input_ids": [ord(c) for c in text]}

        def apply_chat_template(self, messages, **kwargs):
            return [1, *(ord(c) for c in messages[0]["content"]), 2]

    text = "x = 1\n" * 100
    assert render(Tokenizer(), ChatPrompt("raw_code", "m.py", "ab")) == [97, 98]
    assert (
        render(Tokenizer(), ChatPrompt("raw_code", "m.py", text))
        == [ord(c) for c in text][-MAX_PROMPT_TOKENS:]
    )
    assert render(Tokenizer(), ChatPrompt("explain", "m.py", "ab")) == [1, 97, 98, 2]


def test_a_new_run_can_start_from_a_draft_directory(tmp_path, monkeypatch):
    """`initial_weights`: a draft directory's weights load into the draft's shape; another
    shape is refused by the first tensor that differs."""
    from avspec.tools.train.draft import train as train_module

    target = _target()
    saved = target_layers_draft(target, [0, 2])
    with torch.no_grad():
        first = next(p for n, p in saved.named_parameters() if n.startswith("blocks.1."))
        first.add_(1.0)
    monkeypatch.setattr(train_module, "load_model", lambda *a, **k: saved)
    fresh = target_layers_draft(target, [0, 2])
    weights = train_module.initial_weights(tmp_path, fresh)
    fresh.load_state_dict(weights)
    for (name, a), (_, b) in zip(fresh.state_dict().items(), saved.state_dict().items(),
                                 strict=True):  # fmt: skip
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"blocks\.2\..* is nothing"):
        train_module.initial_weights(tmp_path, target_layers_draft(target, [0, 1, 2]))


def test_a_data_phase_still_running_after_training_is_stopped_and_a_failed_one_reported():
    from avspec.tools.train.draft.__main__ import _end_data_phase

    running = _Process(alive=True)
    _end_data_phase(running)  # stopped (exit code -15) without an error
    assert running.terminated
    finished = _Process(alive=False, exitcode=0)
    _end_data_phase(finished)
    assert not finished.terminated
    with pytest.raises(SystemExit, match="exit code 1"):
        _end_data_phase(_Process(alive=False, exitcode=1))
