"""Decoder-only transformer (pre-norm GPT with rotary positions) over a packed ragged batch.

Two entry points share the weights:

- `forward(input_ids)`: a dense [batch, seq] batch from position 0, causal; used for training.
- `forward_cached(cache, seq_ids, input_ids, lengths)`: appends each sequence's new tokens after
  its cached positions in one pass over the whole ragged batch, so prefill of new sequences,
  one-token decode and multi-token verification mix in one call.

Rotary position embeddings (Su et al. 2021, "RoFormer") make a token's position its index in its
own sequence's cache, so sequences of a batch need no shared offsets. Output logits use the
token embedding matrix (tied weights).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from avspec.checks import check_shape
from avspec.runtime.kv_cache import KVCache

ROPE_BASE = 10000.0


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a `Transformer`; `max_length` bounds positions (rotary table size)."""

    num_layers: int
    width: int
    num_heads: int
    vocab_size: int = 257
    max_length: int = 512

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"TransformerConfig.{f.name} must be a positive int, got {value!r}"
                )
        if self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.width // self.num_heads

    def to_dict(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build from a dict, raising ValueError on unknown or missing keys."""
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown TransformerConfig keys: {unknown}")
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"bad TransformerConfig: {err}") from None


class Rotary(nn.Module):
    """Rotate query/key channel pairs (i, i + head_dim/2) by position-dependent angles."""

    def __init__(self, head_dim: int, max_length: int) -> None:
        super().__init__()
        inv_freq = ROPE_BASE ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(max_length, dtype=torch.float64), inv_freq)
        # (position, head_dim / 2); not saved: recomputed from the config
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: [..., seq, heads, head_dim] with `positions` [seq] or x: [tokens, heads, head_dim]
        with `positions` [tokens]."""
        cos = self.cos[positions].unsqueeze(-2).to(x.dtype)  # (..., 1, head_dim / 2)
        sin = self.sin[positions].unsqueeze(-2).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Block(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        w = config.width
        self.num_heads = config.num_heads
        self.head_dim = config.head_dim
        self.attn_norm = nn.RMSNorm(w)
        self.qkv = nn.Linear(w, 3 * w, bias=False)
        self.attn_out = nn.Linear(w, w, bias=False)
        self.mlp_norm = nn.RMSNorm(w)
        self.mlp_in = nn.Linear(w, 4 * w, bias=False)
        self.mlp_out = nn.Linear(4 * w, w, bias=False)

    def project(
        self, x: Tensor, positions: Tensor, rotary: Rotary
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: [..., width] -> rotated q, k and v, each [..., heads, head_dim]."""
        qkv = self.qkv(self.attn_norm(x))
        q, k, v = qkv.unflatten(-1, (3, self.num_heads, self.head_dim)).unbind(-3)
        return rotary(q, positions), rotary(k, positions), v

    def mlp(self, x: Tensor) -> Tensor:
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))

    def forward(self, x: Tensor, rotary: Rotary) -> Tensor:
        """x: [batch, seq, width], positions 0..seq-1, causal."""
        positions = torch.arange(x.shape[1], device=x.device)
        q, k, v = self.project(x, positions, rotary)  # (batch, seq, heads, head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        att = att.transpose(1, 2).flatten(-2)  # (batch, seq, width)
        return self.mlp(x + self.attn_out(att))


class Transformer(nn.Module):
    """Byte-level GPT; see the module docstring for the two forward paths."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.RMSNorm(config.width)
        self.rotary = Rotary(config.head_dim, config.max_length)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, x: Tensor) -> Tensor:
        """x: [..., width] -> [..., vocab] through the tied embedding matrix."""
        return self.final_norm(x) @ self.embed.weight.t()

    def forward(self, input_ids: Tensor) -> Tensor:
        """input_ids: [batch, seq] int64 from position 0 -> logits [batch, seq, vocab]."""
        check_shape("input_ids", input_ids, (None, None))
        if input_ids.shape[1] > self.config.max_length:
            raise ValueError(
                f"input_ids has {input_ids.shape[1]} positions, max_length is "
                f"{self.config.max_length}"
            )
        x = self.embed(input_ids)  # (batch, seq, width)
        for block in self.blocks:
            x = block(x, self.rotary)
        return self.logits(x)

    def new_cache(
        self,
        max_sequences: int,
        max_length: int,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
    ) -> KVCache:
        """A KV cache shaped for this model; device and dtype default to the weights'."""
        self._check_cache_length(max_length)  # before allocating the buffers
        config, weight = self.config, self.embed.weight
        return KVCache(
            config.num_layers, config.num_heads, config.head_dim, max_sequences, max_length,
            weight.device if device is None else device,
            weight.dtype if dtype is None else dtype,
        )  # fmt: skip

    def check_cache(self, cache: KVCache) -> None:
        """ValueError unless `cache` has this model's attention shape and no more positions."""
        config = self.config
        mine = (config.num_layers, config.num_heads, config.head_dim)
        if cache.attention_shape != mine:
            raise ValueError(
                f"KV cache built for (layers, heads, head_dim) {cache.attention_shape}, "
                f"model has {mine}"
            )
        self._check_cache_length(cache.max_length)

    def _check_cache_length(self, max_length: int) -> None:
        if max_length > self.config.max_length:
            raise ValueError(
                f"cache max_length {max_length} exceeds the model's max_length "
                f"{self.config.max_length}"
            )

    def forward_cached(
        self, cache: KVCache, seq_ids: Sequence[int], input_ids: Tensor, lengths: Sequence[int]
    ) -> Tensor:
        """Append new tokens to cached sequences and return their logits.

        input_ids: [tokens] int64, packed: sequence i's tokens are the next lengths[i] entries.
        seq_ids, lengths: host-side, one entry per sequence (every seq id allocated in `cache`,
        no repeats, lengths >= 1). Returns logits [tokens, vocab]. The cache grows by
        lengths[i] positions per sequence; on any error nothing is written.
        """
        lengths = [int(n) for n in lengths]
        check_shape("input_ids", input_ids, (sum(lengths),))
        if len(seq_ids) != len(lengths) or any(n < 1 for n in lengths):
            raise ValueError(
                f"need one length >= 1 per seq id, got {len(seq_ids)} ids, lengths {lengths}"
            )
        self.check_cache(cache)
        slots, starts = cache.reserve(seq_ids, lengths)
        index = _RaggedIndex(slots, starts, lengths, input_ids.device)
        x = self.embed(input_ids)  # (tokens, width)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.project(x, index.positions, self.rotary)  # (tokens, heads, head_dim)
            cache.write(layer, index.token_slots, index.positions, k, v)
            keys, values = cache.read(layer, index.slots, index.key_length)
            # keys, values: (batch, heads, key_length, head_dim), in the model's dtype
            keys, values = keys.to(q.dtype), values.to(q.dtype)
            q_pad = q.new_zeros(len(slots), index.query_length, *q.shape[1:])
            q_pad[index.token_rows, index.token_cols] = q  # (batch, query_length, heads, head_dim)
            att = F.scaled_dot_product_attention(
                q_pad.transpose(1, 2), keys, values, attn_mask=index.mask
            )  # (batch, heads, query_length, head_dim)
            att = att.transpose(1, 2)[index.token_rows, index.token_cols]  # (tokens, heads, hd)
            x = block.mlp(x + block.attn_out(att.flatten(-2)))  # (tokens, width)
        cache.advance(seq_ids, lengths)
        return self.logits(x)


class _RaggedIndex:
    """Host-built index tensors mapping a packed ragged batch to padded attention tiles."""

    def __init__(
        self, slots: list[int], starts: list[int], lengths: list[int], device: torch.device
    ) -> None:
        rows = [b for b, n in enumerate(lengths) for _ in range(n)]
        cols = [j for n in lengths for j in range(n)]
        positions = [starts[b] + j for b, j in zip(rows, cols, strict=True)]
        self.query_length = max(lengths)
        self.key_length = max(s + n for s, n in zip(starts, lengths, strict=True))

        def as_tensor(values: list[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        self.token_rows = as_tensor(rows)  # (tokens,)
        self.token_cols = as_tensor(cols)  # (tokens,)
        self.positions = as_tensor(positions)  # (tokens,)
        self.slots = as_tensor(slots)  # (batch,)
        self.token_slots = self.slots[self.token_rows]  # (tokens,)
        # A query at column j of sequence b sees keys 0..starts[b] + j; padded columns see
        # the same prefix plus stale keys (finite, never NaN) and are dropped afterwards.
        query_pos = as_tensor(starts)[:, None] + torch.arange(self.query_length, device=device)
        key_pos = torch.arange(self.key_length, device=device)
        # (batch, 1, query_length, key_length): broadcast over heads
        self.mask = (key_pos[None, None, :] <= query_pos[:, :, None]).unsqueeze(1)


def init_weights(model: Transformer, generator: torch.Generator) -> None:
    """GPT-2 style initialisation from `generator`: N(0, 0.02), residual outputs scaled down."""
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(("attn_out.weight", "mlp_out.weight")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
