"""`avspec.runtime.head`: the EAGLE-style draft head over the target's features.

- the dense path and the cached path (`forward_cached` with the head's inputs as `embeds`) give
  the same guesses, whole or appended in pieces;
- a new head starts from the target: its embedding is the target's (shared, frozen), its block
  a copy of the chosen target block, and its `fc` passes the token's embedding through;
- saved and loaded it guesses the same (bfloat16 file, tolerance of bf16), and shares the
  target's embedding; a directory of another target's shape, or without the files, is refused
  with the reason.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers.hf_dirs import spread_weights

from avspec.runtime.head import DraftHead, HeadSpec, head_config, load_head, new_head, save_head
from avspec.runtime.transformer import Transformer, TransformerConfig

TARGET = TransformerConfig(
    num_layers=3, width=32, num_heads=4, num_kv_heads=2, vocab_size=50, max_length=128,
    mlp="swiglu", norm_eps=1e-5,
)  # fmt: skip


def _head(seed: int = 0) -> DraftHead:
    return spread_weights(DraftHead(head_config(TARGET)), seed)


@torch.no_grad()
def test_cached_path_equals_dense_path_in_pieces():
    head = _head()
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, 12, TARGET.width, generator=generator)
    tokens = torch.randint(0, TARGET.vocab_size, (1, 12), generator=generator)
    dense = head(features, tokens)[0]
    cache = head.layers.new_cache(1, 64)
    cache.allocate(0)
    pieces = []
    for start, end in ((0, 5), (5, 6), (6, 12)):
        pieces.append(
            head.forward_cached(
                cache, [0], features[0, start:end], tokens[0, start:end], [end - start]
            )  # fmt: skip
        )
    assert torch.allclose(torch.cat(pieces), dense, atol=1e-4, rtol=1e-4)


def test_a_new_head_starts_from_the_target():
    target = spread_weights(Transformer(TARGET), 3)
    head = new_head(target, init_layer=2)
    assert torch.equal(head.layers.embed.weight, target.embed.weight)
    assert not head.layers.embed.weight.requires_grad
    assert torch.equal(head.layers.blocks[0].qkv.weight, target.blocks[2].qkv.weight)
    assert torch.equal(head.layers.final_norm.weight, target.final_norm.weight)
    embedded = target.embed.weight[:4]
    passed = head.fc(torch.cat([torch.zeros(4, TARGET.width), embedded], dim=-1))
    assert torch.allclose(passed, embedded, atol=1e-3)
    with pytest.raises(ValueError, match="init_layer 3"):
        new_head(target, init_layer=3)


@torch.no_grad()
def test_saved_and_loaded_head_guesses_the_same(tmp_path):
    target = spread_weights(Transformer(TARGET), 3)
    head = new_head(target, init_layer=1)
    spread_weights(head.fc, 4)
    save_head(head, HeadSpec(head_config(TARGET), 1, None), tmp_path / "head")
    loaded, spec = load_head(tmp_path / "head", target)
    assert spec.init_layer == 1 and spec.config == head_config(TARGET)
    assert loaded.layers.embed.weight is target.embed.weight
    features = torch.randn(1, 7, TARGET.width, generator=torch.Generator().manual_seed(5))
    tokens = torch.arange(7)[None]
    assert torch.allclose(loaded(features, tokens), head(features, tokens), atol=0.1, rtol=0.05)

    other = Transformer(dataclasses.replace(TARGET, width=64, num_heads=8))
    with pytest.raises(ValueError, match="another target's shape"):
        load_head(tmp_path / "head", other)
    with pytest.raises(ValueError, match="no head.safetensors"):
        load_head(tmp_path, target)
