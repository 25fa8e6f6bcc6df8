"""The draft's shape, and its embedding taken from the target's.

A Llama-form `Transformer` (SwiGLU, RMSNorm, half-split RoPE, grouped-query attention, tied
embedding) with the target's tokenizer, vocabulary, rotary base and context. At this vocabulary
(49,152) the tied embedding is most of a small draft's parameters and of its work (the output
matrix), so the feasibility trial's shape is the starting point: width 256, 4 layers, 4 query /
2 key-value heads of 64, MLP 768 (15.7M parameters, 12.6M of them the embedding).

Embedding initialisation: the top `width` directions of the target's embedding E (SVD,
E = U S V^T) give the draft U[:, :width] S[:width] = E V[:, :width], the projection of every
token's target embedding onto the subspace that carries most of its variance. With a tied head,
inner products between tokens are those of the target up to the dropped directions, so the
draft starts from the target's notion of which tokens are alike instead of noise.
"""

from __future__ import annotations

import torch

from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights


def draft_config(target: TransformerConfig, width: int = 256, layers: int = 4) -> TransformerConfig:
    """The draft's config for `target`: same vocabulary, rotary base and context."""
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


def new_draft(target: Transformer, width: int = 256, layers: int = 4, seed: int = 0) -> Transformer:
    """A freshly initialised float32 draft for `target`, its embedding from the target's SVD."""
    model = Transformer(draft_config(target.config, width, layers))
    init_weights(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():
        model.embed.weight.copy_(svd_embedding(target.embed.weight, width))
    return model
