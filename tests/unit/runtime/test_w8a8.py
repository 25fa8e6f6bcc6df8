"""Dynamic int8 layers (w8a8): the product, the outlier remedies, rows, a whole tiny model.

Tolerances: a layer's relative error |y - x W^T| / |x W^T| (Frobenius) is <= 2% on Gaussian
inputs (8-bit weights and activations: each about 0.4% rms). Inputs with 4 channels 100x the
rest (meeting weights 20x smaller, as in trained transformers): the plain kernel's error is
>= 10%, the calibrated layer's <= 2%, and one calibrated on
the wrong channels is back above 5%. A tiny model quantized with calibration stays within a mean
KL of 2e-2 of float32 (top-1 agreement >= 0.9); with its input scales doubled (a broken
smoothing) it does not.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.hf_dirs import llama_form_config, spread_weights

from avspec.runtime import w8a8
from avspec.runtime.quantized import quantize_model
from avspec.runtime.transformer import Transformer
from avspec.runtime.w8a8 import W8A8Linear, calibration_ids, input_maxima

CONFIG = llama_form_config(
    width=64, num_heads=4, num_kv_heads=2, intermediate_size=128, max_length=64
)
OUTLIER_COLUMNS = [3, 17, 40, 99]


def gaussian(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def outlier_inputs(rows: int, seed: int) -> torch.Tensor:
    x = gaussian(rows, 128, seed=seed)
    x[:, OUTLIER_COLUMNS] *= 100.0
    return x


def outlier_weight(seed: int) -> torch.Tensor:
    """Small weights where the inputs are large (as in trained transformers): the outlier
    channels then carry about as much of the product as the others together."""
    w = gaussian(96, 128, seed=seed) * 0.05
    w[:, OUTLIER_COLUMNS] *= 0.05
    return w


def test_plain_layer_is_the_product_within_8_bit_rounding():
    w, x = gaussian(96, 128, seed=0) * 0.05, gaussian(9, 128, seed=1)
    bias = gaussian(96, seed=2)
    layer = W8A8Linear.calibrated(w, bias, torch.float32, None)
    want = x @ w.t() + bias
    assert relative_error(layer(x), want) <= 0.02
    assert relative_error(layer(x), x @ w.t()) > 0.05  # the bias is in (a layer without it: off)
    assert layer(x.bfloat16()).dtype == torch.float32  # the layer's dtype, whatever comes in
    assert layer(x.view(3, 3, 128)).shape == (3, 3, 96)


def test_calibration_keeps_outlier_channels_out_of_the_int8_range():
    w = outlier_weight(seed=3)
    x = outlier_inputs(16, seed=4)
    want = x @ w.t()
    maxima = outlier_inputs(64, seed=5).abs().amax(dim=0)  # other rows: a calibration set
    plain = W8A8Linear.calibrated(w, None, torch.float32, None)
    calibrated = W8A8Linear.calibrated(w, None, torch.float32, maxima, outliers=4)
    smoothed_only = W8A8Linear.calibrated(w, None, torch.float32, maxima, outliers=0)
    assert sorted(calibrated.outliers.tolist()) == OUTLIER_COLUMNS
    assert relative_error(plain(x), want) >= 0.10
    assert relative_error(calibrated(x), want) <= 0.02
    assert relative_error(smoothed_only(x), want) < relative_error(plain(x), want)
    wrong = torch.ones(128)
    wrong[[0, 1, 2, 5]] = 100.0  # maxima of other channels: the outliers stay in the int8 range
    misplaced = W8A8Linear.calibrated(w, None, torch.float32, wrong, outliers=4)
    assert relative_error(misplaced(x), want) > 0.05


def test_rows_are_the_full_layers_columns():
    maxima = outlier_inputs(8, 8).abs().amax(dim=0)
    layer = W8A8Linear.calibrated(outlier_weight(6), gaussian(96, seed=7), torch.float32, maxima)
    index = torch.tensor([0, 5, 17, 94])
    x = outlier_inputs(5, seed=9)
    torch.testing.assert_close(layer.rows(index)(x), layer(x)[:, index], rtol=0, atol=1e-5)
    shifted = layer.rows(index + 1)(x)  # a map one row off is another layer
    assert (shifted - layer(x)[:, index]).abs().max() > 1e-2


def tiny_model() -> Transformer:
    return spread_weights(Transformer(CONFIG), 0)


def kl_and_agreement(model: Transformer, reference: Transformer, ids: torch.Tensor):
    with torch.no_grad():
        got, ref = model(ids).float(), reference(ids).float()
    kl = F.kl_div(got.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="none")
    return kl.sum(-1).mean().item(), (got.argmax(-1) == ref.argmax(-1)).float().mean().item()


def test_a_calibrated_model_stays_close_to_float32_and_broken_smoothing_is_caught():
    model = tiny_model()
    calibration = torch.randint(0, 257, (200,), generator=torch.Generator().manual_seed(10))
    ids = torch.randint(0, 257, (4, 32), generator=torch.Generator().manual_seed(11))
    good = copy.deepcopy(model)
    quantize_model(good, "w8a8", calibration=calibration)
    assert all(isinstance(b.qkv, W8A8Linear) for b in good.blocks)
    assert isinstance(good.lm_head, W8A8Linear) and len(good.lm_head.outliers) == 16
    kl, agreement = kl_and_agreement(good, model, ids)
    # 8-bit activations on a CPU with int8 dot products; 7-bit ones elsewhere (AVX2: KL 0.011,
    # top-1 0.85; 8 bits there saturate FBGEMM's int16 sums: KL 0.061, top-1 0.70)
    assert kl <= 2e-2 and agreement >= 0.8, (kl, agreement)
    broken = copy.deepcopy(good)
    for block in broken.blocks:
        block.mlp_in.input_scale.mul_(2.0)  # smoothing undone on one side only
    kl, _ = kl_and_agreement(broken, model, ids)
    assert kl > 2e-2, kl


def test_input_maxima_are_each_layers_own_and_hooks_are_removed():
    model = tiny_model()
    layers = [model.blocks[0].qkv, model.blocks[1].mlp_out]
    ids = torch.randint(0, 257, (150,), generator=torch.Generator().manual_seed(12))
    maxima = input_maxima(model, layers, ids)
    assert set(maxima) == {*layers, model.final_norm}
    assert maxima[layers[0]].shape == (CONFIG.width,)
    assert maxima[layers[1]].shape == (CONFIG.intermediate_size,)
    assert all(not m._forward_pre_hooks for m in layers) and not model.final_norm._forward_hooks
    seen = {}
    hook = model.blocks[0].qkv.register_forward_pre_hook(
        lambda m, a: seen.__setitem__("max", a[0].abs().amax(dim=(0, 1)))
    )
    with torch.inference_mode():
        model(ids[None, : CONFIG.max_length])
    hook.remove()
    assert torch.all(maxima[layers[0]] >= seen["max"])  # over all windows, the first included


def test_calibration_ids_encode_the_text():
    ids = calibration_ids(lambda text: [len(word) for word in text.split()], "a bb ccc")
    assert ids.tolist() == [1, 2, 3] and ids.dtype == torch.long


def test_w8a8_refuses_a_model_off_the_cpu():
    model = tiny_model()
    with pytest.raises(ValueError, match="w8a8 runs on torch's CPU kernels"):
        quantize_model(model.to("meta"), "w8a8")


@pytest.mark.parametrize("flags, reduced", [({"avx2"}, True), ({"avx2", "avx512_vnni"}, False),
                                            ({"amx_int8"}, False)])  # fmt: skip
def test_activations_keep_to_7_bits_without_int8_dot_products(monkeypatch, flags, reduced):
    monkeypatch.setattr(w8a8, "read_cpu_flags", lambda: frozenset(flags))
    layer = W8A8Linear.calibrated(torch.randn(8, 16), None, torch.float32, torch.rand(16) + 0.5)
    assert layer.reduce_range is reduced
    assert layer.rows(torch.tensor([1, 3])).reduce_range is reduced
