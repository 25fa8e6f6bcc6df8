"""Decoder-only transformer (pre-norm, rotary positions) over a packed ragged batch.

Two entry points share the weights:

- `forward(input_ids)`: a dense [batch, seq] batch from position 0, causal; used for training.
- `forward_cached(cache, seq_ids, input_ids, lengths)`: appends each sequence's new tokens after
  its cached positions in one pass over the whole ragged batch, so prefill of new sequences,
  one-token decode and multi-token verification mix in one call.

Rotary position embeddings (`avspec.runtime.rope`) make a token's position its index in its
own sequence's cache, so sequences of a batch need no shared offsets. The cached path attends
with `avspec.runtime.attention.grouped_attention` (batched products, not torch's fused kernel,
which is slow on the CPU for a few queries, in bfloat16 most); its rotary angles are looked up
once per step, and q and k are turned in one rotation.

One `TransformerConfig` covers two families. Its defaults are the project's own byte-level
GPT: RMSNorm (torch's default epsilon), one fused q/k/v projection, GELU MLP of width 4 x width,
no biases, output logits through the token embedding (tied), rotary base 10000 on channel
pairs (i, i + head_dim/2). The Llama family (Llama, Qwen2, Mistral; loaded by
`avspec.runtime.hf_checkpoint`) sets `mlp="swiglu"` (silu(gate) * up, then down),
`norm_eps`, grouped-query attention (`num_kv_heads` < `num_heads`: each key/value head
serves num_heads / num_kv_heads query heads, and the KV cache holds only the key/value heads),
`head_dim`, q/k/v and output biases, `mlp_bias`, an untied output matrix (`lm_head`), and the
rotary base and frequency scaling.

Parameter names: `embed.weight`, `blocks.<i>.attn_norm.weight`, `blocks.<i>.qkv.weight` (rows:
q heads, then k heads, then v heads; `.bias` with `qkv_bias`), `blocks.<i>.attn_out.weight`
(`.bias` with `out_bias`), `blocks.<i>.mlp_norm.weight`, `blocks.<i>.mlp_in.weight` (GELU: the
hidden layer; SwiGLU: gate rows then up rows), `blocks.<i>.mlp_out.weight` (`.bias` on both
MLP layers with `mlp_bias`), `final_norm.weight`, `lm_head.weight` when untied. Served in int8
or int4 (`avspec.runtime.quantized.quantize_model`) the four projections of each block and the
output matrix are replaced by quantized layers (a tied model then gets an int8 `lm_head`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from avspec.checks import check_shape
from avspec.runtime.attention import grouped_attention
from avspec.runtime.kv_cache import KVCache
from avspec.runtime.ragged import AttentionTile, RaggedIndex
from avspec.runtime.rope import ROPE_STYLES, RopeScaling, Rotary

ROPE_BASE = 10000.0
MLP_KINDS = ("gelu", "swiglu")
_POSITIVE_INTS = ("num_layers", "width", "num_heads", "vocab_size", "max_length")
_RESOLVED_INTS = ("num_kv_heads", "head_dim", "intermediate_size")  # None: derived
_BOOLS = ("qkv_bias", "out_bias", "mlp_bias", "tie_embeddings")


@dataclass(frozen=True)
class TransformerConfig:
    """Architecture of a `Transformer`; `max_length` bounds positions (rotary table size).

    `num_kv_heads`, `head_dim` and `intermediate_size` left as None are derived at
    construction (num_heads, width / num_heads, 4 x width), so a config always holds concrete
    sizes and `from_dict(to_dict())` round-trips. `norm_eps` None is torch's RMSNorm default
    (the machine epsilon of the activations' dtype).
    """

    num_layers: int
    width: int
    num_heads: int
    vocab_size: int = 257
    max_length: int = 512
    # None in the constructor only: __post_init__ derives the size, so the field is an int
    num_kv_heads: int = None  # type: ignore[assignment]
    head_dim: int = None  # type: ignore[assignment]
    intermediate_size: int = None  # type: ignore[assignment]
    mlp: str = "gelu"
    norm_eps: float | None = None
    qkv_bias: bool = False
    out_bias: bool = False
    mlp_bias: bool = False
    tie_embeddings: bool = True
    rope_theta: float = ROPE_BASE
    rope_style: str = "half"
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        for name in _POSITIVE_INTS:
            _check_positive_int(name, getattr(self, name))
        if self.head_dim is None and self.width % self.num_heads:
            raise ValueError(f"width {self.width} is not divisible by num_heads {self.num_heads}")
        derived = {
            "num_kv_heads": self.num_heads,
            "head_dim": self.width // max(self.num_heads, 1),
            "intermediate_size": 4 * self.width,
        }
        for name in _RESOLVED_INTS:
            if getattr(self, name) is None:
                object.__setattr__(self, name, derived[name])
            _check_positive_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for rotary embeddings")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"TransformerConfig.{name} must be a bool, got {getattr(self, name)!r}"
                )
        if self.mlp not in MLP_KINDS:
            raise ValueError(f"TransformerConfig.mlp must be one of {MLP_KINDS}, got {self.mlp!r}")
        if self.rope_style not in ROPE_STYLES:
            raise ValueError(
                f"TransformerConfig.rope_style must be one of {ROPE_STYLES}, "
                f"got {self.rope_style!r}"
            )
        object.__setattr__(self, "rope_theta", _positive_float("rope_theta", self.rope_theta))
        if self.norm_eps is not None:
            object.__setattr__(self, "norm_eps", _positive_float("norm_eps", self.norm_eps))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", RopeScaling.from_dict(self.rope_scaling))

    @property
    def kv_values_per_token(self) -> int:
        """Key and value entries one cached token holds across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TransformerConfig:
        """Build from a dict, raising ValueError on unknown or missing keys.

        Keys added after the first model directories (everything after `max_length`) may be
        missing: their defaults are the original architecture.
        """
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


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"TransformerConfig.{name} must be a positive int, got {value!r}")


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ValueError(f"TransformerConfig.{name} must be a positive number, got {value!r}")
    return float(value)


class Block(nn.Module):
    """One pre-norm block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        w, hd = config.width, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        self.gated = config.mlp == "swiglu"
        hidden = config.intermediate_size
        self.attn_norm = nn.RMSNorm(w, eps=config.norm_eps)
        self.qkv = nn.Linear(w, (config.num_heads + 2 * config.num_kv_heads) * hd, config.qkv_bias)
        self.attn_out = nn.Linear(config.num_heads * hd, w, bias=config.out_bias)
        self.mlp_norm = nn.RMSNorm(w, eps=config.norm_eps)
        self.mlp_in = nn.Linear(w, (2 if self.gated else 1) * hidden, bias=config.mlp_bias)
        self.mlp_out = nn.Linear(hidden, w, bias=config.mlp_bias)

    @property
    def grouped(self) -> bool:
        return self.num_kv_heads != self.num_heads

    def project(
        self, x: Tensor, rotary: Rotary, angles: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor, Tensor]:
        """x: [..., n, width] -> rotated q [..., n, heads, head_dim], rotated k and v
        [..., n, kv_heads, head_dim]; `angles`: `rotary.angles` of the n positions.

        q and k heads are adjacent rows of the fused projection: one rotation turns both.
        """
        qkv = self.qkv(self.attn_norm(x)).unflatten(-1, (-1, self.head_dim))
        qk, v = qkv.split((self.num_heads + self.num_kv_heads, self.num_kv_heads), dim=-2)
        q, k = rotary.rotate(qk, angles).split((self.num_heads, self.num_kv_heads), dim=-2)
        return q, k, v

    def mlp(self, x: Tensor) -> Tensor:
        h = self.mlp_in(self.mlp_norm(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h)
        return x + self.mlp_out(h)

    def forward(self, x: Tensor, rotary: Rotary) -> Tensor:
        """x: [batch, seq, width], positions 0..seq-1, causal."""
        angles = rotary.angles(torch.arange(x.shape[1], device=x.device), x.dtype)
        q, k, v = self.project(x, rotary, angles)  # (batch, seq, heads, head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.grouped)
        att = att.transpose(1, 2).flatten(-2)  # (batch, seq, heads * head_dim)
        return self.mlp(x + self.attn_out(att))


class _Embedding(nn.Embedding):
    """nn.Embedding that skips its random initialisation on the meta device (`empty`).

    The meta kernel of `normal_` is Python (torch's decompositions): its first call imports
    sympy and more, tens of MiB resident. Elsewhere the initialisation is nn.Embedding's.
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class Transformer(nn.Module):
    """Decoder-only transformer; see the module docstring for the two forward paths."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = _Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.RMSNorm(config.width, eps=config.norm_eps)
        self.lm_head: nn.Module | None = (  # quantize_model replaces it
            None
            if config.tie_embeddings
            else nn.Linear(config.width, config.vocab_size, bias=False)
        )
        self.rotary = Rotary(
            config.head_dim, config.max_length, config.rope_theta, config.rope_scaling,
            config.rope_style,
        )  # fmt: skip

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (the stages' vocabulary, before any `vocab_limit`)."""
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return next(self.parameters()).device

    @classmethod
    def empty(
        cls,
        config: TransformerConfig,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> Transformer:
        """A model with uninitialised weights in `dtype` on `device`, for a loader to fill.

        Built on the meta device first, so no weight is ever allocated twice or initialised;
        each tensor is then allocated in place. (`Module.to_empty`, and random or arange ops on
        the meta device, would import torch's Python decompositions and sympy on first use:
        tens of MiB resident for nothing, see `_Embedding`.)
        """
        with torch.device("meta"):
            model = cls(config)
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                empty = torch.empty(param.shape, dtype=dtype, device=device)
                setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
            for name, buffer in list(module.named_buffers(recurse=False)):
                setattr(module, name, torch.empty(buffer.shape, dtype=dtype, device=device))
        model.rotary.reset()
        return model

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def logits(self, x: Tensor) -> Tensor:
        """x: [..., width] -> [..., vocab] through the output matrix (tied: the embedding,
        unless quantization gave the model its own `lm_head`)."""
        if self.lm_head is None:
            return self.final_norm(x) @ self.embed.weight.t()
        return self.lm_head(self.final_norm(x))

    def subset_logits(self, x: Tensor, rows: Tensor) -> Tensor:
        """x: [..., width] -> [..., kept]: the logits of the output-matrix rows `rows`
        [kept, width] only (a float copy of some rows of the matrix `logits` multiplies by,
        gathered once by the caller: `avspec.engine.draft_vocab.ReducedHead`)."""
        return self.final_norm(x) @ rows.t()

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
        pool_tokens: int = 0,
    ) -> KVCache:
        """A KV cache shaped for this model (one pool of `pool_tokens` cells shared by the
        sequences; 0: max_sequences x max_length); device and dtype default to the weights'."""
        self._check_cache_length(max_length)  # before allocating the buffers
        config, weight = self.config, self.embed.weight
        return KVCache(
            config.num_layers, config.num_kv_heads, config.head_dim, max_sequences, max_length,
            weight.device if device is None else device,
            weight.dtype if dtype is None else dtype,
            pool_tokens,
        )  # fmt: skip

    def check_cache(self, cache: KVCache) -> None:
        """ValueError unless `cache` has this model's attention shape and no more positions."""
        config = self.config
        mine = (config.num_layers, config.num_kv_heads, config.head_dim)
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
        self,
        cache: KVCache,
        seq_ids: Sequence[int],
        input_ids: Tensor,
        lengths: Sequence[int],
        *,
        hidden: bool = False,
        at: Tensor | None = None,
        embeds: Tensor | None = None,
    ) -> Tensor:
        """Append new tokens to cached sequences and return their logits.

        input_ids: [tokens] int64, packed: sequence i's tokens are the next lengths[i] entries.
        seq_ids, lengths: host-side, one entry per sequence (every seq id allocated in `cache`,
        no repeats, lengths >= 1). Returns logits [tokens, vocab]. The cache grows by
        lengths[i] positions per sequence; on any error nothing is written.

        `hidden`: return the last block's output [tokens, width] instead (before `final_norm`),
        for a caller with its own output layer (`subset_logits`: the draft stage's reduced
        vocabulary) that needs the logits of a few tokens or of a few ids only. `at` [n] int64:
        the logits (or hidden states) of those packed tokens only, [n, vocab]: the output layer
        is then applied to n rows, not to every token (a first step's prompt tokens need their
        keys and values cached, not logits over the vocabulary). `embeds` [tokens, width]: the
        first block's input instead of the tokens' embeddings (a draft head's,
        `avspec.runtime.head`).
        """
        lengths = [int(n) for n in lengths]
        check_shape("input_ids", input_ids, (sum(lengths),))
        if len(seq_ids) != len(lengths) or any(n < 1 for n in lengths):
            raise ValueError(
                f"need one length >= 1 per seq id, got {len(seq_ids)} ids, lengths {lengths}"
            )
        self.check_cache(cache)
        slots, starts = cache.reserve(seq_ids, lengths)
        index = RaggedIndex(slots, starts, lengths, input_ids.device, max_cells=cache.read_cells)
        cells = cache.cells(index.token_slots, index.positions)
        key_cells = [cache.key_cells(tile.slots, tile.key_length) for tile in index.tiles]
        x = self.embed(input_ids) if embeds is None else embeds  # (tokens, width)
        angles = self.rotary.angles(index.positions, x.dtype)
        for layer, block in enumerate(cast("list[Block]", self.blocks)):
            # q: (tokens, heads, head_dim); k, v: (tokens, kv_heads, head_dim)
            q, k, v = block.project(x, self.rotary, angles)
            cache.write(layer, cells, k, v)
            att = _tiled_attention(cache, layer, index.tiles, key_cells, q)
            x = block.mlp(x + block.attn_out(att.flatten(-2)))  # (tokens, width)
        cache.advance(seq_ids, lengths)
        if at is not None:
            x = x[at]
        return x if hidden else self.logits(x)


def _tiled_attention(
    cache: KVCache, layer: int, tiles: list[AttentionTile], key_cells: list[Tensor], q: Tensor
) -> Tensor:
    """Attention of the packed queries q [tokens, heads, head_dim] over the cache, tile by
    tile (`avspec.runtime.ragged`; `key_cells`: each tile's, from `KVCache.key_cells`)
    -> [tokens, heads, head_dim]."""

    def attend(tile: AttentionTile, cells: Tensor, queries: Tensor) -> Tensor:
        keys, values = cache.read(layer, cells)
        # keys, values: (kv_heads, rows, key_length, head_dim), in the model's dtype
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        return tile.unpad(grouped_attention(tile.pad(queries), keys, values, tile.bias))

    if len(tiles) == 1:
        return attend(tiles[0], key_cells[0], q)
    out = torch.empty_like(q)
    for tile, cells in zip(tiles, key_cells, strict=True):
        out[tile.token_index] = attend(tile, cells, q[tile.token_index])
    return out


def init_weights(model: Transformer, generator: torch.Generator) -> None:
    """GPT-2 style initialisation from `generator`: N(0, 0.02), residual outputs scaled down,
    norms 1, biases 0."""
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            elif name.endswith(("attn_out.weight", "mlp_out.weight")):
                param.normal_(0.0, residual_std, generator=generator)
            else:
                param.normal_(0.0, 0.02, generator=generator)
