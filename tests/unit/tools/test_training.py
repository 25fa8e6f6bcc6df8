"""Training pieces: corpus split, schedule, loss, top-p warp, acceptance measurement."""

from __future__ import annotations

import math

import pytest
import torch

from avspec.engine.sampling import warp_probs
from avspec.runtime.model_dir import save_model_dir
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.training import (
    TOPICS_PREFIX,
    TrainSettings,
    acceptance_by_position,
    bits_per_byte,
    corpus_files,
    encode_files,
    heldout_prompts,
    is_held_out,
    lr_at,
    model_card,
    sample,
    split_files,
    train_model,
    warp,
)

TINY = TransformerConfig(num_layers=1, width=16, num_heads=2, max_length=64)


def tiny_model(seed: int) -> Transformer:
    model = Transformer(TINY)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model.eval()


def test_split_is_deterministic_disjoint_and_covers_both_kinds():
    files = corpus_files()
    train, held_out = split_files(files)
    assert (train, held_out) == split_files(corpus_files())
    train_names, held_names = {n for n, _ in train}, {n for n, _ in held_out}
    assert not train_names & held_names
    assert train_names | held_names == {n for n, _ in files}
    assert 0.05 < len(held_out) / len(files) < 0.2
    for part in (train_names, held_names):
        assert any(n.startswith(TOPICS_PREFIX) for n in part)
        assert any(n.endswith(".py") and "/" not in n for n in part)
    assert all(is_held_out(n) for n in held_names)


def test_split_requires_code_and_prose():
    code_only = [(f"m{i}.py", "x = 1\n") for i in range(50)]
    with pytest.raises(ValueError, match="lacks code or prose"):
        split_files(code_only)


def test_encode_files_joins_with_eos():
    ids = encode_files([("a", "hi"), ("b", "é")], ByteTokenizer())
    assert ids.tolist() == [104, 105, 256, 0xC3, 0xA9, 256]


def test_lr_schedule_warms_up_then_decays_to_a_tenth():
    settings = TrainSettings(steps=1000, lr=1e-3, warmup=100)
    assert lr_at(0, settings) == pytest.approx(1e-5)
    assert lr_at(99, settings) == pytest.approx(1e-3)
    assert lr_at(100, settings) == pytest.approx(1e-3)
    assert lr_at(1000, settings) == pytest.approx(1e-4)
    assert lr_at(550, settings) == pytest.approx(5.5e-4)


def test_uniform_model_costs_log2_vocab_bits():
    model = tiny_model(0)
    with torch.no_grad():
        model.embed.weight.zero_()  # logits all zero: uniform over 257 tokens
    ids = torch.arange(200) % 257
    assert bits_per_byte(model, ids, seq=16, max_windows=5) == pytest.approx(math.log2(257))


@pytest.fixture()
def one_thread():
    """Tiny models run faster on one thread, and the machine is shared with training."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_train_model_is_seeded_and_lowers_the_loss(one_thread):
    data = torch.tensor(list(b"abcabcabd" * 60), dtype=torch.int64)
    settings = TrainSettings(steps=15, batch=4, seq=16, lr=3e-2, warmup=3)
    a, log = train_model(TINY, settings, data, data, seed=1, label="test")
    b, _ = train_model(TINY, settings, data, data, seed=1, label="test")
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [entry["step"] for entry in log] == [15]
    assert log[0]["held_out_bpb"] < 3.0  # from 8 bits (uniform) on a 3-letter pattern


def test_warp_is_the_serving_warp_for_both_shapes():
    """training.warp must sample what the stages sample (avspec.engine.sampling.warp_probs)."""
    logits = torch.randn(3, 4, 20, generator=torch.Generator().manual_seed(1))
    settings = (torch.full((3,), 0.7), torch.full((3,), 0.9))
    expected = warp_probs(logits, *settings)
    torch.testing.assert_close(warp(logits, 0.7, 0.9), expected)
    torch.testing.assert_close(warp(logits[:, 0], 0.7, 0.9), expected[:, 0])


def test_acceptance_is_one_for_identical_models_and_below_for_different():
    prompts = torch.randint(0, 256, (6, 10), generator=torch.Generator().manual_seed(0))
    same = acceptance_by_position(tiny_model(0), tiny_model(0), prompts, num_positions=4)
    assert same == pytest.approx([1.0] * 4, abs=1e-5)
    gen = torch.Generator().manual_seed(0)
    other = acceptance_by_position(tiny_model(0), tiny_model(1), prompts, 3, generator=gen)
    assert len(other) == 3 and all(0.0 < a < 1.0 for a in other)


def test_heldout_prompts_and_sample():
    files = [("m.py", "x = 1\n" * 50), (TOPICS_PREFIX + "t", "Some prose here. " * 20)]
    prompts = heldout_prompts(files, count=4, length=12, prose=True)
    assert prompts.shape == (4, 12)
    assert ByteTokenizer().decode(prompts[0].tolist()) == "Some prose h"
    text = sample(tiny_model(0), "ab", 5, torch.Generator().manual_seed(0))
    assert text.startswith("ab")


def test_model_card_lists_both_models_and_the_curve(tmp_path):
    models = {}
    for name in ("draft", "target"):
        save_model_dir(tmp_path / name, tiny_model(0), ByteTokenizer())
        models[name] = {"config": TINY.to_dict(), "parameters": 1234, "train_seconds": 90.0,
                        "settings": {"steps": 10, "batch": 2, "seq": 16}}  # fmt: skip
    log = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "corpus": {
            "train_files": 9,
            "train_bytes": 1000,
            "held_out_files": 1,
            "held_out_bytes": 99,
        },
        "models": models,
        "report": {
            "held_out_bpb": {"draft": 2.5, "target": 2.0},
            "acceptance_by_position": {"code": [0.7] * 8},
            "samples": {"target": {"python": "def f():"}},
        },
    }
    card = model_card(tmp_path, log)
    assert "| target | 1 | 16 | 2 | 1,234 |" in card and "| 2.000 |" in card
    assert "| code | 0.700 |" in card and "def f():" in card
