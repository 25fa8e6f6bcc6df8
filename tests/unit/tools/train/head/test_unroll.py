"""`avspec.tools.train.head.unroll`: training-time test is the served chain, position by position.

Position j at depth d of the dense unroll must equal the d-th draft of a chain the head makes
on its cached path: the target's features up to position j - d + 1 appended, then the head's
own guesses fed back as the next inputs, with the data's tokens. Checked at every position and
depth 1..3 of a random head; a mask that let a deeper query see the depth-1 entries of the
positions its chain replaces (plain causal attention at every depth) fails it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.hf_dirs import spread_weights

import avspec.tools.train.head.unroll as unroll_module
from avspec.runtime.head import DraftHead, head_config
from avspec.runtime.transformer import TransformerConfig
from avspec.tools.train.head.unroll import chain_mask, unroll

TARGET = TransformerConfig(
    num_layers=2, width=32, num_heads=4, num_kv_heads=2, vocab_size=40, max_length=64,
    mlp="swiglu", norm_eps=1e-5,
)  # fmt: skip
LENGTH, DEPTH = 9, 3


@torch.no_grad()
def _served_chain(head: DraftHead, features, tokens, start: int, depth: int) -> torch.Tensor:
    """The depth-th guess of a chain after position `start`, on the cached path."""
    cache = head.layers.new_cache(1, 64)
    cache.allocate(0)
    guess = head.forward_cached(cache, [0], features[: start + 1], tokens[: start + 1],
                                [start + 1])[-1:]  # fmt: skip
    for k in range(1, depth):
        position = start + k
        guess = head.forward_cached(cache, [0], guess, tokens[position : position + 1], [1])
    return guess[0]


def _check(head: DraftHead) -> None:
    generator = torch.Generator().manual_seed(7)
    features = torch.randn(1, LENGTH, TARGET.width, generator=generator)
    tokens = torch.randint(0, TARGET.vocab_size, (1, LENGTH), generator=generator)
    with torch.no_grad():
        guesses = unroll(head, features, tokens, DEPTH)
    for depth in range(1, DEPTH + 1):
        for j in range(depth - 1, LENGTH):
            served = _served_chain(head, features[0], tokens[0], j - depth + 1, depth)
            assert torch.allclose(guesses[depth - 1][0, j], served, atol=1e-4, rtol=1e-4), (
                depth, j,
            )  # fmt: skip


def test_every_position_and_depth_is_the_served_chain():
    _check(spread_weights(DraftHead(head_config(TARGET)), 0))


def test_a_causal_mask_at_every_depth_is_caught(monkeypatch):
    def causal(length: int, depth: int) -> torch.Tensor:
        j, i = torch.arange(length)[:, None], torch.arange(length)[None, :]
        parts = [i <= j] + [i == j - (depth - k) for k in range(2, depth + 1)]
        return torch.cat(parts, dim=1)

    monkeypatch.setattr(unroll_module, "chain_mask", causal)
    with pytest.raises(AssertionError):
        _check(spread_weights(DraftHead(head_config(TARGET)), 0))


def test_chain_mask_rows():
    mask = chain_mask(4, 2)  # depth 2: depth-1 keys up to j - 1, then its own key
    assert mask[2].tolist() == [True, True, False, False, False, False, True, False]
    assert mask[0].tolist() == [False] * 4 + [True, False, False, False]
