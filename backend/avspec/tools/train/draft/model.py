"""The draft's shape: a few of the target's own layers over the target's embedding.

A draft is a Llama-form `Transformer` with the target's tokenizer, vocabulary, rotary base and
context. Two shapes, named by a checkpoint's `shape` dict:

- `{"target_layers": [0, 1, 2]}` (the default): the target's width, heads and MLP, with
  `len(target_layers)` blocks initialised from those blocks of the target, the target's final
  norm, and the target's embedding, tied and frozen. Training moves the blocks and the norm
  only, so the embedding (most of the parameters at this vocabulary: 28.3M of SmolLM2's 135M)
  stays bit-equal to the target's and need not ship with the draft: the committed draft holds
  the rest and `avspec.tools.train.draft_embedding` fills the embedding in from the target.
  Untrained, three of thirty layers are no draft (acceptance 0.04 on held-out answers); they
  learn fast because their inputs and the output matrix already speak the target's language
  (docs/smollm2.md: 0.39 after 9 minutes of training where a fresh draft reached 0.15).
- `{"width": 256, "layers": 4}` (the first drafts): a fresh model of that width, 4 query / 2
  key-value heads of 64, MLP 3 x width, its tied embedding initialised from the target's top
  `width` SVD directions (U S = E V[:, :width]: inner products between tokens are the
  target's up to the dropped directions) and trained with the rest.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights

DEFAULT_SHAPE: dict[str, Any] = {"target_layers": [0, 1, 2]}


def draft_config(target: TransformerConfig, shape: dict[str, Any]) -> TransformerConfig:
    """The draft's config for `target` and a checkpoint's `shape` (see the module docstring)."""
    if "target_layers" in shape:
        return dataclasses.replace(target, num_layers=len(shape["target_layers"]))
    width, layers = shape["width"], shape["layers"]
    return TransformerConfig(
        num_layers=layers,
        width=width,
        num_heads=width // 64,
        num_kv_heads=max(1, width // 128),
        head_dim=64,
        intermediate_size=3 * width,
        vocab_size=target.vocab_size,
        max_length=target.max_length,
        mlp="swiglu",
        norm_eps=target.norm_eps,
        tie_embeddings=True,
        rope_theta=target.rope_theta,
        rope_scaling=target.rope_scaling,
    )


def svd_embedding(target_embedding: torch.Tensor, width: int) -> torch.Tensor:
    """[vocab, width]: the target's embedding [vocab, target width] projected on its top
    `width` right singular directions (U S of the truncated SVD)."""
    u, s, _ = torch.linalg.svd(target_embedding.float(), full_matrices=False)
    return u[:, :width] * s[:width]


def target_layers_draft(target: Transformer, layers: Sequence[int]) -> Transformer:
    """A float32 draft of the target's blocks `layers` (in that order), final norm and
    embedding; the embedding frozen (`requires_grad` False)."""
    if not target.config.tie_embeddings:
        raise ValueError("a target-layers draft needs a target with tied embeddings")
    if not layers or any(not 0 <= i < target.config.num_layers for i in layers):
        last = target.config.num_layers - 1
        raise ValueError(f"target_layers {list(layers)}: the target has layers 0..{last}")
    model = Transformer(draft_config(target.config, {"target_layers": list(layers)}))
    with torch.no_grad():
        model.embed.weight.copy_(target.embed.weight)
        model.final_norm.weight.copy_(target.final_norm.weight)
        for block, i in zip(model.blocks, layers, strict=True):
            block.load_state_dict({k: v.float() for k, v in target.blocks[i].state_dict().items()})
    model.embed.weight.requires_grad_(False)
    return model


def new_draft(target: Transformer, shape: dict[str, Any], seed: int = 0) -> Transformer:
    """A float32 draft for `target` of `shape`, ready to train."""
    if "target_layers" in shape:
        return target_layers_draft(target, shape["target_layers"])
    model = Transformer(draft_config(target.config, shape))
    init_weights(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.embed.weight.copy_(svd_embedding(target.embed.weight, shape["width"]))
    return model


def skeleton(target: TransformerConfig, shape: dict[str, Any]) -> Transformer:
    """An untrained draft of `shape` to load a checkpoint into (embedding frozen as trained)."""
    model = Transformer(draft_config(target, shape))
    if "target_layers" in shape:
        model.embed.weight.requires_grad_(False)
    return model
