"""Grouped attention over cached keys against torch's fused kernel, and the step's fast paths.

`grouped_attention` (float32; keys and values head-major, as the KV cache gathers them) must
equal `scaled_dot_product_attention` with `enable_gqa` to 1e-5 under any mask; mapping query
heads to key/value heads the wrong way round is caught. A batch whose sequences all bring the
same number of tokens (reshaped, not scattered) must give each sequence's logits alone, as
ragged batches do (test_transformer).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_dirs import llama_form_config, spread_weights

from avspec.runtime.attention import grouped_attention, mask_bias
from avspec.runtime.transformer import Transformer


def inputs(batch: int, queries: int, heads: int, kv_heads: int, keys: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, queries, heads, 16, generator=gen)
    k, v = (torch.randn(batch, kv_heads, keys, 16, generator=gen) for _ in range(2))
    # each query sees a prefix of the keys, at least one, of a random length per row
    seen = torch.randint(1, keys + 1, (batch, queries, 1), generator=gen)
    allowed = torch.arange(keys)[None, None, :] < seen
    return q, k, v, allowed


def fused(q, k, v, allowed):
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k, v, attn_mask=allowed[:, None], enable_gqa=True
    )
    return out.transpose(1, 2)


@pytest.mark.parametrize(
    ("batch", "queries", "heads", "kv_heads"),
    [(1, 1, 9, 3), (4, 9, 9, 3), (3, 5, 4, 4), (2, 3, 8, 1)],
    ids=["decode_gqa", "verify_gqa", "mha", "mqa"],
)
def test_grouped_attention_equals_the_fused_kernel(batch, queries, heads, kv_heads):
    q, k, v, allowed = inputs(batch, queries, heads, kv_heads, keys=20)
    got = grouped_attention(q, k.transpose(0, 1), v.transpose(0, 1), mask_bias(allowed))
    assert got.shape == q.shape
    torch.testing.assert_close(got, fused(q, k, v, allowed), rtol=0, atol=1e-5)


def test_a_wrong_head_grouping_is_caught():
    """Query head h reads key/value head h // group; h % kv_heads is a different model."""
    q, k, v, allowed = inputs(2, 3, 6, 3, keys=12)
    group = 6 // 3
    interleaved = q.unflatten(2, (group, 3)).transpose(2, 3).flatten(2, 3)
    wrong = grouped_attention(interleaved, k.transpose(0, 1), v.transpose(0, 1), mask_bias(allowed))
    wrong = wrong.unflatten(2, (3, group)).transpose(2, 3).flatten(2, 3)
    assert (wrong - fused(q, k, v, allowed)).abs().max() > 1e-2


def test_mask_bias_blocks_exactly_the_disallowed_keys():
    allowed = torch.tensor([[[True, False, True]]])
    bias = mask_bias(allowed)
    assert bias.shape == (1, 1, 1, 1, 3) and bias.dtype == torch.float32
    assert bias.flatten().tolist() == [0.0, -float("inf"), 0.0]


def test_uniform_batch_equals_each_sequence_alone():
    config = llama_form_config(num_heads=4, num_kv_heads=2, max_length=64)
    model = spread_weights(Transformer(config), 3)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 257, (n,), generator=gen) for n in (5, 9, 2)]
    batch, alone = model.new_cache(3, 64), model.new_cache(3, 64)
    with torch.no_grad():
        for seq_id, prompt in enumerate(prompts):
            for cache in (batch, alone):
                cache.allocate(seq_id)
                model.forward_cached(cache, [seq_id], prompt, [len(prompt)])
        for n in (1, 4):  # decode, then verify 4 tokens per sequence: the uniform path
            ids = torch.randint(0, 257, (3 * n,), generator=gen)
            together = model.forward_cached(batch, [0, 1, 2], ids, [n] * 3)
            pieces = [
                model.forward_cached(alone, [i], chunk, [n]) for i, chunk in enumerate(ids.split(n))
            ]
            torch.testing.assert_close(together, torch.cat(pieces), rtol=0, atol=1e-5)
