"""Reduced draft vocabulary: the map file's validation, the reduced output layer, and the draft
stage with a map (q = 0 outside the kept ids, the kept ids' logits those of the full model).

Exactness of the output law with a map: tests/unit/av/test_drafting_exact.py (exact) and
tests/unit/engine/test_stage_lossless.py (through the real stages).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.stages import K, make_draft_stage, make_inputs, tiny_model

from avspec.av.features import logit_qmax
from avspec.engine.draft_vocab import (
    DRAFT_VOCAB_FILE,
    DraftVocab,
    DraftVocabError,
    ReducedHead,
    draft_vocab_path,
    load_draft_vocab,
    save_draft_vocab,
    scatter_kept,
)
from avspec.engine.sampling import warp_probs
from avspec.runtime.quantized import quantize_model
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")

VOCAB = 257  # the tiny models'
KEPT = [0, 3, 5, 17, 40, 41, 99, 200, 256]
SPARSE = [t for t in range(VOCAB) if t % 3 != 1]  # 171 ids: enough for varied drafts


# --- the map file --------------------------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    path = tmp_path / DRAFT_VOCAB_FILE
    save_draft_vocab(path, [5, 3, 3, 0], "unit test", vocab_size=VOCAB, coverage={"mass": 0.5})
    vocab = load_draft_vocab(path, VOCAB)
    assert vocab.token_ids == (0, 3, 5)  # sorted, deduplicated on save
    assert (vocab.source, vocab.path, len(vocab)) == ("unit test", str(path), 3)
    assert json.loads(path.read_text())["coverage"] == {"mass": 0.5}  # informational keys kept


def test_path_is_relative_to_the_model_directory(tmp_path: Path) -> None:
    assert draft_vocab_path(tmp_path, "draft_vocab.json") == tmp_path / "draft_vocab.json"
    assert draft_vocab_path(tmp_path, "/abs/map.json") == Path("/abs/map.json")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", "not JSON"),
        ("[1, 2]", "must be a JSON object, got list"),
        ('{"source": "x"}', "no `token_ids` key"),
        ('{"token_ids": 5}', "token_ids must be a list of ints, got int"),
        ('{"token_ids": []}', "token_ids is empty"),
        ('{"token_ids": [1, 2.0]}', r"token_ids\[1\] = 2.0 is not an int"),
        ('{"token_ids": [true]}', r"token_ids\[0\] = True is not an int"),
        ('{"token_ids": [-1, 2]}', r"token_ids\[0\] = -1 is outside the vocabulary 0..256"),
        ('{"token_ids": [1, 257]}', r"token_ids\[1\] = 257 is outside the vocabulary 0..256"),
        ('{"token_ids": [1, 4, 3]}', r"token_ids\[2\] = 3 is below token_ids\[1\] = 4: ids must"),
        ('{"token_ids": [1, 4, 4]}', r"token_ids\[2\] = 4 repeats token_ids\[1\] = 4"),
        ('{"token_ids": [1], "source": 3}', "source must be a string, got int"),
    ],
)
def test_bad_maps_are_refused_naming_file_and_problem(
    tmp_path: Path, text: str, match: str
) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(DraftVocabError, match=match) as err:
        load_draft_vocab(path, VOCAB)
    assert str(path) in str(err.value)


def test_missing_map_names_the_file_and_the_tool(tmp_path: Path) -> None:
    with pytest.raises(DraftVocabError, match="no such file") as err:
        load_draft_vocab(tmp_path / "absent.json", VOCAB)
    assert str(tmp_path / "absent.json") in str(err.value)
    assert "avspec.tools.train.draft_vocab" in str(err.value)


def test_in_memory_map_is_checked_too() -> None:
    assert DraftVocab.of(torch.tensor([1, 2]), 3).token_ids == (1, 2)
    with pytest.raises(DraftVocabError, match="outside the vocabulary 0..2"):
        DraftVocab.of([1, 3], 3)


# --- the reduced output layer --------------------------------------------------------------------


def untied_model(seed: int) -> Transformer:
    return tiny_model(seed, tie_embeddings=False)


@pytest.mark.parametrize("build", [tiny_model, untied_model], ids=["tied", "untied"])
def test_kept_logits_equal_the_full_models(build) -> None:
    model = build(0)
    head = ReducedHead(model, DraftVocab.of(KEPT, VOCAB))
    x = torch.randn(5, model.config.width, dtype=torch.float64)
    full = model.logits(x)
    torch.testing.assert_close(head.kept_logits(x), full[:, KEPT], rtol=1e-12, atol=1e-12)
    scattered = head(x)
    assert scattered.shape == full.shape
    torch.testing.assert_close(scattered[:, KEPT], full[:, KEPT], rtol=1e-12, atol=1e-12)
    others = torch.ones(VOCAB, dtype=torch.bool)
    others[KEPT] = False
    assert torch.all(scattered[:, others] == float("-inf"))


@pytest.mark.parametrize("tokens", [3, 40], ids=["int8-kernel", "dequantized"])
def test_an_int8_head_keeps_its_rows_and_kernels(tokens: int) -> None:
    """A quantized model's int8 output layer: the kept rows' logits are the full layer's (the
    int8 kernel up to 32 tokens, the dequantized product above)."""
    model = tiny_model(1).float()
    quantize_model(model, "int8")
    head = ReducedHead(model, DraftVocab.of(KEPT, VOCAB))
    x = torch.randn(tokens, model.config.width)
    torch.testing.assert_close(head.kept_logits(x), model.logits(x)[:, KEPT])


def test_a_w8a8_head_keeps_its_rows_and_smoothing() -> None:
    """A w8a8 model's output layer: the kept rows' logits are the full layer's (same int8
    values, scales, input scales and outlier channels)."""
    model = tiny_model(1).float()
    calibration = torch.randint(0, VOCAB, (96,), generator=torch.Generator().manual_seed(3))
    quantize_model(model, "w8a8", calibration=calibration)
    head = ReducedHead(model, DraftVocab.of(KEPT, VOCAB))
    x = torch.randn(7, model.config.width)
    torch.testing.assert_close(head.kept_logits(x), model.logits(x)[:, KEPT])


def test_scatter_kept_places_values_and_minus_inf() -> None:
    kept = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = scatter_kept(kept, torch.tensor([0, 2]), 4)
    inf = float("-inf")
    assert out.tolist() == [[1.0, inf, 2.0, inf], [3.0, inf, 4.0, inf]]


def test_the_rows_are_a_copy_taken_at_load() -> None:
    model = tiny_model(0)
    head = ReducedHead(model, DraftVocab.of(KEPT, VOCAB))
    assert head.rows is not None and head.rows.shape == (len(KEPT), model.config.width)
    assert head.rows.data_ptr() != model.embed.weight.data_ptr()
    assert len(head) == len(KEPT)


# --- the draft stage with a map ------------------------------------------------------------------


def masked_reference(model: Transformer, context: list[int], drafts: list[int]) -> torch.Tensor:
    """Full-recompute logits predicting each draft, -inf outside SPARSE: [len(drafts), vocab]."""
    ids = torch.tensor([context + drafts[:-1]]) if drafts else torch.tensor([context])
    logits = model(ids)[0, len(context) - 1 :].float()
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[SPARSE] = False
    return logits.masked_fill(outside, float("-inf"))


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.8)])
def test_stage_q_is_the_masked_full_models_over_accept_reject_cycles(
    temperature: float, top_p: float
) -> None:
    """Three sequences (K, 2 and 0 drafts) for 5 steps with random accepts: each drafted q is
    the warp of the full model's logits with -inf outside the map (zero there, sum 1), each
    feature logit(q_max) of those same logits, each draft inside the map."""
    model = tiny_model(0)
    stage = make_draft_stage(model, draft_vocab=DraftVocab.of(SPARSE, VOCAB))
    rng = torch.Generator().manual_seed(1)
    seqs = {1: [3, 1, 4, 1, 5], 2: [9, 2], 3: [7]}
    caps = {1: K, 2: 2, 3: 0}
    pending = {s: (list(c), 0) for s, c in seqs.items()}
    starts = dict.fromkeys(seqs, 0)
    kept = torch.zeros(VOCAB, dtype=torch.bool)
    kept[SPARSE] = True
    for _ in range(5):
        rows = [
            {"seq_id": s, "tokens": pending[s][0], "start": starts[s], "reusable": pending[s][1],
             "n": caps[s], "seed": s, "temperature": temperature, "top_p": top_p}
            for s in seqs
        ]  # fmt: skip
        out = stage(make_inputs(rows))
        for r, s in enumerate(seqs):
            n = caps[s]
            drafts = out.draft_tokens[r, :n].tolist()
            logits = masked_reference(model, seqs[s], drafts)[:n]
            temp = torch.full((n,), temperature)
            want = warp_probs(logits[None].transpose(0, 1), temp, torch.full((n,), top_p))[:, 0]
            torch.testing.assert_close(out.draft_probs[r, :n], want, atol=1e-5, rtol=1e-4)
            features = logit_qmax(logits[:, None], temp)[:, 0]
            torch.testing.assert_close(out.draft_features[r, :n], features, atol=1e-5, rtol=1e-4)
            assert torch.all(out.draft_probs[r, :n][:, ~kept] == 0)
            torch.testing.assert_close(out.draft_probs[r, :n].sum(-1), torch.ones(n))
            assert all(kept[t] for t in drafts)
            # accept a random prefix, then a correction from outside the map (1 mod 3)
            accepted = int(torch.randint(0, n + 1, (), generator=rng))
            new = drafts[:accepted] + [1 + 3 * int(torch.randint(0, 85, (), generator=rng))]
            starts[s] = len(seqs[s])
            seqs[s] = seqs[s] + new
            pending[s] = (new, accepted)


def test_greedy_drafts_the_argmax_within_the_map() -> None:
    model = tiny_model(2)
    full = make_draft_stage(model)
    reduced = make_draft_stage(model, draft_vocab=DraftVocab.of(SPARSE, VOCAB))
    row = {"seq_id": 1, "tokens": [5, 17, 200, 3], "temperature": 0.0}
    out = reduced(make_inputs([row]))
    context = [5, 17, 200, 3]
    for position, token in enumerate(out.draft_tokens[0].tolist()):
        logits = masked_reference(model, context, out.draft_tokens[0, : position + 1].tolist())
        assert token == int(logits[position].argmax())
    assert full(make_inputs([row])).draft_probs.shape == out.draft_probs.shape


def test_top_k_and_vocab_limit_with_a_map() -> None:
    """draft_top_k and vocab_limit still apply on top of the map; ids past the limit refused."""
    model = tiny_model(3)
    stage = make_draft_stage(
        model,
        top_k=4,
        vocab_limit=200,
        draft_vocab=DraftVocab.of([t for t in SPARSE if t < 200], VOCAB),
    )
    out = stage(make_inputs([{"seq_id": 1, "tokens": [1, 2, 3], "top_p": 0.95}]))
    assert out.draft_probs.shape[-1] == 200
    assert int((out.draft_probs > 0).sum(-1).max()) <= 4
    assert torch.all(out.draft_probs[..., 1::3] == 0)  # ids 1 mod 3 are outside the map
    with pytest.raises(DraftVocabError, match=r"token_ids\[\d+\] = 200 is outside the vocabulary"):
        make_draft_stage(model, vocab_limit=200, draft_vocab=DraftVocab.of(SPARSE, VOCAB))


def test_a_map_of_every_id_drafts_like_no_map() -> None:
    """Keeping every id: same drafts, q and features as the full output layer."""
    model = tiny_model(4)
    rows = [{"seq_id": 1, "tokens": [5, 6, 7], "temperature": 0.8, "top_p": 0.9, "seed": 3},
            {"seq_id": 2, "tokens": [9], "temperature": 1.0, "seed": 4}]  # fmt: skip
    a = make_draft_stage(model)(make_inputs(rows))
    b = make_draft_stage(model, draft_vocab=DraftVocab.of(range(VOCAB), VOCAB))(make_inputs(rows))
    assert torch.equal(a.draft_tokens, b.draft_tokens)
    torch.testing.assert_close(a.draft_probs, b.draft_probs)
    torch.testing.assert_close(a.draft_features, b.draft_features)
