"""Attention of a step's new queries over cached keys, as grouped matrix products.

`forward_cached` attends a few new queries per sequence (1 when decoding, K + 1 when verifying)
to a cache of up to max_length keys. torch's fused CPU kernel
(`scaled_dot_product_attention`, flash) is built for long query blocks: in bfloat16 it costs
about 90 us per call at one query against 128 keys (15 us in float32), and at 64 rows x 1 query
about 10 ms per layer (measured on this project's CPU, 1 thread), the largest cost of a bf16
step. Two batched matrix products do the same work at a fraction of it: the query heads that
share a key/value head (grouped-query attention) are stacked as rows of one product, scores
are softmaxed in float32, and the probabilities (in the activations' dtype) weight the values.
In bfloat16 the scores are rounded to bfloat16 before the softmax, as `transformers`' eager
attention rounds them; in float32 the result equals the fused kernel's to rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def mask_bias(allowed: Tensor) -> Tensor:
    """Additive float32 bias from a boolean mask: 0 where attending is allowed, -inf elsewhere.

    `allowed`: [batch, query_length, key_length]. The bias is shaped
    [1, batch, 1, query_length, key_length] for `grouped_attention`'s scores
    [kv_heads, batch, group, query_length, key_length]; built once per step, used by every layer.
    """
    bias = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
    return bias.masked_fill_(~allowed, -math.inf)[None, :, None]


def grouped_attention(q: Tensor, keys: Tensor, values: Tensor, bias: Tensor) -> Tensor:
    """Softmax attention of `q` over `keys`/`values` with an additive `bias` (`mask_bias`).

    q: [batch, query_length, heads, head_dim]; keys, values: [kv_heads, batch, key_length,
    head_dim] (head-major, as the KV cache gathers them), heads a multiple of kv_heads (query
    head h reads key/value head h // (heads / kv_heads), as `enable_gqa` and Llama's repeat_kv
    do). Every query must be allowed at least one key. Returns [batch, query_length, heads,
    head_dim] in q's dtype.
    """
    batch, query_length, heads, head_dim = q.shape
    kv_heads, key_length = keys.shape[0], keys.shape[2]
    group = heads // kv_heads
    # (kv_heads, batch, group * query_length, head_dim): one product per key/value head and row
    stacked = (q * (1.0 / math.sqrt(head_dim))).view(batch, query_length, kv_heads, group, -1)
    stacked = stacked.permute(2, 0, 3, 1, 4).reshape(kv_heads, batch, -1, head_dim)
    scores = torch.matmul(stacked, keys.transpose(-1, -2))
    scores = scores.view(kv_heads, batch, group, query_length, key_length) + bias
    probs = torch.softmax(scores, dim=-1).to(values.dtype)
    out = torch.matmul(probs.view(kv_heads, batch, group * query_length, key_length), values)
    out = out.view(kv_heads, batch, group, query_length, head_dim).permute(1, 3, 0, 2, 4)
    return out.reshape(batch, query_length, heads, head_dim)
