"""Evaluation: bits/byte, the serving warp, acceptance by position, samples."""

from __future__ import annotations

import math

import pytest
import torch

from avspec.engine.sampling import warp_probs
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.train.tiny.evaluate import acceptance_by_position, bits_per_byte, sample, warp

TINY = TransformerConfig(num_layers=1, width=16, num_heads=2, max_length=64)


def tiny_model(seed: int) -> Transformer:
    model = Transformer(TINY)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model.eval()


def test_uniform_model_costs_log2_vocab_bits():
    model = tiny_model(0)
    with torch.no_grad():
        model.embed.weight.zero_()  # logits all zero: uniform over 257 tokens
    ids = torch.arange(200) % 257
    assert bits_per_byte(model, ids, seq=16, max_windows=5) == pytest.approx(math.log2(257))


def test_warp_is_the_serving_warp_for_both_shapes():
    """evaluate.warp must sample what the stages sample (avspec.engine.sampling.warp_probs)."""
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


def test_sample_continues_the_prompt():
    text = sample(tiny_model(0), "ab", 5, torch.Generator().manual_seed(0))
    assert text.startswith("ab")


def test_bits_per_byte_divides_by_the_bytes_tokens_spell():
    """Every token spelling 2 bytes halves the bits per byte; a wrong length table changes it."""
    model = tiny_model(0)
    with torch.no_grad():
        model.embed.weight.zero_()
    ids = torch.arange(200) % 257
    twos = torch.full((257,), 2, dtype=torch.int64)
    per_byte = bits_per_byte(model, ids, seq=16, max_windows=5, byte_lengths=twos)
    assert per_byte == pytest.approx(math.log2(257) / 2)


def test_token_byte_lengths_of_a_byte_level_bpe(tmp_path):
    """The lengths of a text's tokens add up to its UTF-8 bytes (multibyte characters too)."""
    from helpers.hf_dirs import CORPUS

    from avspec.runtime.hf_tokenizer import HFTokenizer
    from avspec.tools.train.tiny.bpe import save_tokenizer, train_bpe
    from avspec.tools.train.tiny.evaluate import token_byte_lengths

    tok = HFTokenizer.from_directory(save_tokenizer(train_bpe(CORPUS, 300), tmp_path, 64))
    lengths = token_byte_lengths(tok)
    text = "def add(a, b):\n    return a + b  # é ✓"
    assert int(lengths[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    assert lengths[min(tok.eos_ids)] == 1
