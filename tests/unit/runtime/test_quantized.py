"""Weight-only int8/int4 layers: quantization error, both compute paths, a whole tiny model.

Tolerances (float32 activations unless said): a quantized weight is within half a
quantization step of the original; a quantized layer's output equals the product with its
dequantized weight to 1e-5 relative (bfloat16: 2e-2 of the output scale); a quantized model
equals the float32 model carrying the dequantized weights to 1e-4, and int8 stays within a
mean KL of 5e-3 (top-1 agreement >= 0.9: random logits have near ties) of the original
float32 model on the tiny model below (int4 of random Gaussian weights is far coarser: it is
checked against its dequantized model only). Each check has a deliberately broken variant that
it catches.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_dirs import llama_form_config, spread_weights

from avspec.runtime import quantized
from avspec.runtime.quantized import (
    DequantScratch,
    Int4Linear,
    Int8Linear,
    quantize_int4,
    quantize_int8,
    quantize_model,
)
from avspec.runtime.transformer import Transformer

# every projection fits the int4 kernel: rows multiples of 16, inputs multiples of 32
CONFIG = llama_form_config(
    width=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_length=64
)


def weight(rows: int = 96, cols: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05


def int4_dense(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The documented int4 form: w = (q - 8) * scale + zero within each group."""
    group = q.shape[1] // scales.shape[1]
    return (q.float() - 8) * scales.repeat_interleave(group, 1) + zeros.repeat_interleave(group, 1)


def test_int8_error_is_within_half_a_step_and_a_wrong_scale_is_caught():
    w = weight()
    q, scales = quantize_int8(w)
    assert q.dtype == torch.int8 and q.abs().max() == 127
    error = (q.float() * scales[:, None] - w).abs()
    assert torch.all(error <= scales[:, None] / 2 + 1e-7)
    wrong = scales * 2.0  # e.g. max / 63.5: every weight twice as large
    assert not torch.all((q.float() * wrong[:, None] - w).abs() <= wrong[:, None] / 2 + 1e-7)


def test_int4_error_is_within_half_a_step_and_a_wrong_zero_is_caught():
    w = weight()
    q, scales, zeros = quantize_int4(w, 32)
    assert q.dtype == torch.uint8 and q.min() == 0 and q.max() == 15
    step = scales.repeat_interleave(32, 1)
    assert torch.all((int4_dense(q, scales, zeros) - w).abs() <= step / 2 + 1e-6)
    off_by_one = int4_dense(q, scales, zeros - scales)  # the zero point one step off
    assert not torch.all((off_by_one - w).abs() <= step / 2 + 1e-6)
    with pytest.raises(ValueError, match="group size"):
        quantize_int4(weight(cols=48), 32)


def layers(dtype: torch.dtype) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """Each quantized layer over the same float weight and bias, with its dequantized weight."""
    w, bias, scratch = weight(), torch.randn(96) * 0.1, DequantScratch()
    q8, s8 = quantize_int8(w)
    q4, s4, z4 = quantize_int4(w, 32)
    return {
        "int8": (Int8Linear(w, bias, dtype, scratch), q8.float() * s8[:, None]),
        "int4": (Int4Linear(w, bias, dtype, scratch, 32), int4_dense(q4, s4, z4)),
    }


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [1, 5, 70], ids=["kernel_1", "kernel_5", "dense_70"])
def test_layer_equals_the_product_with_its_dequantized_weight(kind, tokens):
    layer, dense_weight = layers(torch.float32)[kind]
    assert (tokens <= layer.kernel_max_tokens) == (tokens < 70)  # both paths are covered
    x = torch.randn(tokens, 128, generator=torch.Generator().manual_seed(2))
    want = F.linear(x, dense_weight, layer.bias)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    # a layer whose scales are wrong by 1% is caught by the same comparison
    broken = copy.deepcopy(layer)
    for name in ("scales", "scales_and_zeros", "scales_t"):
        if hasattr(broken, name):
            getattr(broken, name).mul_(1.01)
    assert not torch.allclose(broken(x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_bfloat16_kernel_and_dense_paths_agree(kind):
    layer, dense_weight = layers(torch.bfloat16)[kind]
    x = torch.randn(3, 4, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    kernel = layer(x)  # 12 tokens: the kernel
    layer.kernel_max_tokens = 0  # this instance only: the dense path
    dense = layer(x)
    want = F.linear(x.float(), dense_weight, layer.bias.float())
    assert kernel.shape == dense.shape == (3, 4, 96) and kernel.dtype == torch.bfloat16
    scale = want.abs().max().item()
    assert (kernel.float() - want).abs().max().item() <= 2e-2 * scale
    assert (dense.float() - want).abs().max().item() <= 2e-2 * scale


def test_int4_shapes_the_kernel_cannot_take_are_refused():
    scratch = DequantScratch()
    with pytest.raises(ValueError, match="multiples of 16.*\\[40, 64\\]"):
        Int4Linear(weight(40, 64), None, torch.float32, scratch)
    with pytest.raises(ValueError, match="group size must be one of"):
        Int4Linear(weight(), None, torch.float32, scratch, group_size=16)
    model = Transformer(llama_form_config(width=40, num_heads=2))  # 40 rows: int4 refused
    before = [type(block.qkv) for block in model.blocks]
    with pytest.raises(ValueError, match="use int8"):
        quantize_model(model, "int4")
    assert [type(block.qkv) for block in model.blocks] == before  # nothing replaced
    quantize_model(model, "int8")
    assert all(isinstance(block.qkv, Int8Linear) for block in model.blocks)


def tiny_model() -> Transformer:
    return spread_weights(Transformer(CONFIG), 0)


def int8_dense(w: torch.Tensor) -> torch.Tensor:
    q, scales = quantize_int8(w)
    return q.float() * scales[:, None]


def dequantized_model(model: Transformer, kind: str) -> Transformer:
    """`model` in float32 with what `quantize_model` quantizes replaced by its dequantized
    value: block projections in `kind`, the output matrix in int8 (an untied head here: the
    embedding lookup stays float)."""
    out = copy.deepcopy(model)
    with torch.no_grad():
        for block in out.blocks:
            for name in ("qkv", "attn_out", "mlp_in", "mlp_out"):
                w = getattr(block, name).weight
                w.copy_(int8_dense(w) if kind == "int8" else int4_dense(*quantize_int4(w, 32)))
        out.lm_head = torch.nn.Linear(CONFIG.width, CONFIG.vocab_size, bias=False)
        out.lm_head.weight.copy_(int8_dense(model.embed.weight))
    return out


def logits(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).float()


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_model_is_its_dequantized_model(kind):
    model = tiny_model()
    ids = torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(4))
    quantized_model = copy.deepcopy(model)
    quantize_model(quantized_model, kind)
    layer_type = Int8Linear if kind == "int8" else Int4Linear
    assert all(isinstance(b.mlp_in, layer_type) for b in quantized_model.blocks)
    assert isinstance(quantized_model.lm_head, Int8Linear)  # the output matrix: int8 in both
    want = logits(dequantized_model(model, kind), ids)
    torch.testing.assert_close(logits(quantized_model, ids), want, rtol=0, atol=1e-4)
    other = "int4" if kind == "int8" else "int8"  # the other scheme is another model
    assert (logits(dequantized_model(model, other), ids) - want).abs().max() > 1e-2


def test_int8_model_stays_close_to_float32_and_a_wrong_scale_is_caught(monkeypatch):
    model = tiny_model()
    ids = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(5))
    ref = logits(model, ids)

    def kl_and_agreement(q_model: Transformer) -> tuple[float, float]:
        got = logits(q_model, ids)
        kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
        return kl.sum(-1).mean().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()

    good = copy.deepcopy(model)
    quantize_model(good, "int8")
    kl, agreement = kl_and_agreement(good)
    assert kl <= 5e-3 and agreement >= 0.9, (kl, agreement)

    def clipping(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # scale of max / 254
        q, scales = quantize_int8(w)
        return torch.round(w.float() / (scales[:, None] / 2)).clamp(-127, 127).to(
            torch.int8
        ), scales

    monkeypatch.setattr(quantized, "quantize_int8", clipping)
    broken = copy.deepcopy(model)
    quantize_model(broken, "int8")
    kl, agreement = kl_and_agreement(broken)
    assert kl > 5e-3, (kl, agreement)


def test_cached_steps_through_the_kernels_match_one_dense_pass():
    """forward_cached in 4-token steps (the kernels) against one pass over all 24 tokens (the
    dense path above the int4 layers' kernel_max_tokens only if more: compare in float32)."""
    model = tiny_model()
    quantize_model(model, "int4")
    ids = torch.randint(0, 257, (24,), generator=torch.Generator().manual_seed(6))
    cache = model.new_cache(1, 64)
    cache.allocate(0)
    with torch.no_grad():
        steps = torch.cat([model.forward_cached(cache, [0], c, [len(c)]) for c in ids.split(4)])
        for module in model.modules():
            if isinstance(module, Int8Linear | Int4Linear):
                module.kernel_max_tokens = 0
        whole = model(ids[None])[0]
    torch.testing.assert_close(steps, whole, rtol=0, atol=1e-4)
