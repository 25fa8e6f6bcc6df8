"""Dynamic int8 linear layers ("w8a8"): int8 weights, each call's activations quantized to int8.

Why: the weight-only kernels of `avspec.runtime.quantized` read every weight once per row, so
verifying 9 tokens costs them 3-4x one token. FBGEMM's int8 GEMM (`quantized::linear_dynamic`
over weights prepacked by `quantized::linear_prepack`, on avx512_vnni's dot products where the
CPU has them) reads each weight once per call: measured here over the 120 block matrices of
SmolLM2-135M on one thread, 12 ms at 9 tokens against 28 (int4 weight-only) and 38 (bfloat16),
44 ms at 64 tokens against 91 (bfloat16). llama.cpp does the same with a 4-bit file: its
activations go to 8-bit blocks before the dot products.

Accuracy: the kernel quantizes its input with one scale per call, and a few input channels of
a transformer carry activations tens of times larger than the rest, which then get all the
levels. Two remedies, calibrated once at load on a fixed text (`calibration_ids`):

- smoothing (SmoothQuant, Xiao et al. 2023): channel j of the input is divided by
  s_j = max|x_j|^alpha / max|W[:, j]|^(1 - alpha) and column j of the weight multiplied by it,
  the same product with the outliers' range moved into the weights (`SMOOTHING_ALPHA`);
- the `OUTLIER_CHANNELS` channels with the largest calibrated max|x_j| are left out of the int8
  product (their input scaled by 0, their weight column zeroed, so neither the activations'
  nor the weight rows' scales see them) and added back by a float32 product over those
  channels alone.

Measured against float32 over 256 positions of the project's docs (8 tokens per call): plain
w8a8 mean KL 0.11 (top-1 agreement 0.82), smoothing alone 0.026-0.030, outliers alone 0.015,
both 0.011 (0.945), about int8 weight-only's 0.007: the per-channel int8 weights are the floor.
The scale is one per call, over every row of the batch, so a row's rounding depends on the
rows beside it; the weight-only precisions do not have that property.

On a CPU without int8 dot products into int32 (`cpu_features.has_int8_dot`: AVX-512 VNNI or
AMX; an AVX2-only CPU, say) FBGEMM sums pairs of u8 x s8 products in saturating int16, which
wraps large activations; there the activations are quantized to 7 bits (`reduce_range`, as
torch's own x86 quantization does). Measured on the tiny test model on an AVX2 host: mean KL
0.061 (top-1 0.70) with 8 bits, 0.011 (0.85) with 7.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from avspec.runtime.cpu_features import has_int8_dot, read_cpu_flags
from avspec.runtime.weight_rounding import quantize_int8

if TYPE_CHECKING:
    from avspec.runtime.transformer import Transformer

SMOOTHING_ALPHA = 0.5
OUTLIER_CHANNELS = 16
CALIBRATION_WINDOW = 128  # tokens per calibration forward

# A fixed mix of the text a served model meets (a chat turn, prose, code), written for this
# project: what the calibrated input maxima are measured on.
CALIBRATION_TEXT = """<|im_start|>system
You are a helpful assistant.<|im_end|>
<|im_start|>user
Why does the sky look blue in the afternoon and red at sunset?<|im_end|>
<|im_start|>assistant
Sunlight holds every colour. Air molecules scatter short wavelengths far more than long ones,
so blue light is bounced across the whole sky while we look away from the sun. At sunset the
light crosses much more air before it reaches us, the blue is scattered out on the way, and
the reds and oranges are what is left.<|im_end|>
<|im_start|>user
Write a Python function that returns the n-th Fibonacci number.<|im_end|>
<|im_start|>assistant
def fibonacci(n: int) -> int:
    \"\"\"The n-th Fibonacci number, F(0) = 0 and F(1) = 1.\"\"\"
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
<|im_end|>
The harbour town woke slowly. Fishing boats came back before dawn, gulls argued over the nets,
and by eight the market stalls were selling bread, cheese, apples and the morning's catch. In
1987 the old lighthouse was turned into a museum; it still draws 40,000 visitors a year.
Steps: 1. Preheat the oven to 200 C. 2. Mix the flour, salt and yeast. 3. Knead for ten
minutes, rest for an hour, shape, and bake for 25 minutes until golden.
"""


class W8A8Linear(nn.Module):
    """y = x @ W.T + bias on FBGEMM's int8 GEMM, with smoothing and outlier channels.

    W's int8 values `q` [out, in] and per-output-channel `scales` hold W * s (smoothed columns,
    zero at the outlier channels); the input is multiplied by `input_scale` [in] (1 / s, zero
    at the outliers) and quantized per call by the kernel; the `outliers` channels' inputs
    multiply `outlier_weight` [outliers, out] (W's columns, float32). Float32 inside; the layer
    returns `dtype`. Build one from float weights with `calibrated`.
    """

    input_scale: Tensor  # buffers
    outliers: Tensor
    outlier_weight: Tensor

    def __init__(
        self,
        q: Tensor,
        scales: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
        input_scale: Tensor,
        outliers: Tensor,
        outlier_weight: Tensor,
        reduce_range: bool | None = None,
    ) -> None:
        super().__init__()
        with warnings.catch_warnings():  # torch marks its quantized tensors deprecated
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch._make_per_channel_quantized_tensor(
                q, scales.double(), torch.zeros(len(scales), dtype=torch.int64), 0
            )
        fbias = None if bias is None else bias.detach().float()
        self._packed = torch.ops.quantized.linear_prepack(qweight, fbias)
        self.dtype = dtype
        self.out_features = q.shape[0]
        # None: 7-bit activations where this CPU lacks int8 dot products (see the module text)
        self.reduce_range = (
            not has_int8_dot(read_cpu_flags()) if reduce_range is None else reduce_range
        )
        self.register_buffer("input_scale", input_scale.float().contiguous())
        self.register_buffer("outliers", outliers.long().contiguous())
        self.register_buffer("outlier_weight", outlier_weight.float().contiguous())

    @classmethod
    def calibrated(
        cls,
        weight: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
        input_max: Tensor | None,
        alpha: float = SMOOTHING_ALPHA,
        outliers: int = OUTLIER_CHANNELS,
    ) -> W8A8Linear:
        """The layer for float `weight` [out, in]; `input_max` [in] the calibrated max |x_j|
        (None: no smoothing and no outlier channels, the plain kernel)."""
        w = weight.detach().float()
        columns = w.shape[1]
        if input_max is None:
            smooth = torch.ones(columns)
            index = torch.zeros(0, dtype=torch.long)
        else:
            floor = torch.finfo(torch.float32).tiny
            amax = input_max.detach().float().clamp_min(floor)
            smooth = amax.pow(alpha) / w.abs().amax(dim=0).clamp_min(floor).pow(1.0 - alpha)
            smooth = smooth.clamp_min(1e-5)
            index = amax.topk(min(outliers, columns)).indices.sort().values
        input_scale = 1.0 / smooth
        input_scale[index] = 0.0
        smoothed = w * smooth
        smoothed[:, index] = 0.0
        q, scales = quantize_int8(smoothed)
        return cls(q, scales, bias, dtype, input_scale, index, w[:, index].t())

    def rows(self, index: Tensor) -> W8A8Linear:
        """A layer of output rows `index` of this one: the same int8 values, scales and
        smoothing (a reduced draft vocabulary's head)."""
        qweight, bias = torch.ops.quantized.linear_unpack(self._packed)
        return W8A8Linear(
            qweight.int_repr()[index].contiguous(),
            qweight.q_per_channel_scales()[index].float(),
            None if bias is None else bias[index],
            self.dtype,
            self.input_scale,
            self.outliers,
            self.outlier_weight[:, index],
            self.reduce_range,
        )

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.quantized.linear_dynamic(
            flat * self.input_scale, self._packed, self.reduce_range
        )
        if len(self.outliers):
            y = torch.addmm(y, flat.index_select(1, self.outliers).float(), self.outlier_weight)
        return y.to(self.dtype).view(*x.shape[:-1], self.out_features)


def calibration_ids(
    tokenizer_encode: Callable[[str], list[int]], text: str = CALIBRATION_TEXT
) -> Tensor:
    """[tokens] int64: `text` encoded by the model's tokenizer (`encode(str) -> list[int]`)."""
    return torch.tensor(tokenizer_encode(text), dtype=torch.long)


def input_maxima(model: Transformer, layers: Iterable[nn.Module], ids: Tensor) -> dict:
    """{layer: max |x_j| [in]} over the inputs `layers` (modules of `model`) see while `model`
    reads `ids` in windows of `CALIBRATION_WINDOW` tokens (at most its context); the output
    matrix's input is recorded under `model.final_norm` (its output)."""
    maxima: dict[nn.Module, Tensor] = {}

    def record(module: nn.Module, x: Tensor) -> None:
        peak = x.detach().float().reshape(-1, x.shape[-1]).abs().amax(dim=0)
        maxima[module] = torch.maximum(maxima[module], peak) if module in maxima else peak

    handles = [layer.register_forward_pre_hook(lambda m, a: record(m, a[0])) for layer in layers]
    handles.append(model.final_norm.register_forward_hook(lambda m, a, out: record(m, out)))
    try:
        with torch.inference_mode():
            window_size = min(CALIBRATION_WINDOW, model.config.max_length)
            for window in ids.to(model.embed.weight.device).split(window_size):
                model(window[None])
    finally:
        for handle in handles:
            handle.remove()
    return maxima
