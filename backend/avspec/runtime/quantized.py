"""Weight-only int8 and int4 linear layers for the CPU, and quantizing a loaded model in place.

Why: a step over a few rows streams every weight from memory once and does little arithmetic
on it, so its time is the weights' bytes over the memory bandwidth (SmolLM2-135M: 270 MB in
bfloat16, about 25 ms on one thread here). Stored in 8 or 4 bits the same step streams a half
or a quarter of that. torch's CPU kernels multiply activations by such weights directly:
`torch._weight_int8pack_mm` (int8 weights, one scale per output channel) and
`torch._weight_int4pack_mm_for_cpu` (4-bit weights in groups of 32 to 256 inputs, a scale and an
offset per group: w = (q - 8) * scale + zero, q in 0..15; weights packed by
`torch._convert_weight_to_int4pack_for_cpu`, needing output rows a multiple of 16).

Those kernels are built for few rows: measured here they fall behind a bfloat16 matrix product
past a few tens of tokens (at 576 tokens the int8 kernel takes about 4x as long). A layer
therefore runs its kernel up to `kernel_max_tokens` tokens and, above, dequantizes its weights
into a scratch buffer shared by the model's layers and runs an ordinary product: the same
quantized model, computed the way that is fast for the batch.

Quantization (`avspec.runtime.weight_rounding`): int8 per output channel; int4 per group of
`group_size` inputs, the scheme of GGUF's Q4_1 blocks, so a target converted from a Q4_1 file
at group size 32 gets its file's 4-bit weights back (up to the scales' rounding to the
activations' dtype). The int4 kernel's packed layout is private to torch, so the dequantized
path keeps its own copy of the nibbles (two per byte): int4 holds about 1 byte per weight, a
small step streams 0.5.

`w8a8` (`avspec.runtime.w8a8`) quantizes the activations of each product too: int8 weights
and an int8 GEMM that reads each weight once per call.

`quantize_model` turns every block projection of a `Transformer` into such layers, and the
output matrix (the tied embedding's transpose too) into int8 in every mode (w8a8: a w8a8
layer): GGUF's 4-bit files keep their token embedding at 8 bits as well. The embedding lookup
itself stays in the activations' dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor, nn

from avspec.runtime.w8a8 import W8A8Linear, input_maxima
from avspec.runtime.weight_rounding import quantize_int4, quantize_int8

if TYPE_CHECKING:
    from avspec.runtime.transformer import Transformer

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's int4 CPU kernel accepts
INT4_ROW_MULTIPLE = 16  # the int4 packing needs output rows in multiples of this
WEIGHT_KINDS = ("int8", "int4", "w8a8")


class DequantScratch:
    """One buffer the quantized layers of a model dequantize into, grown to the largest weight.

    A fresh allocation per call would cost page faults on every large product (the output
    matrix alone is 56 MB in bfloat16); the layers of one model run one after another, so one
    buffer serves them all.
    """

    def __init__(self) -> None:
        self._buffer: Tensor | None = None

    def take(self, shape: tuple[int, int], dtype: torch.dtype) -> Tensor:
        """An uninitialised [rows, cols] view of the buffer, valid until the next `take`."""
        size = shape[0] * shape[1]
        if self._buffer is None or self._buffer.dtype != dtype or self._buffer.numel() < size:
            self._buffer = torch.empty(size, dtype=dtype)
        return self._buffer[:size].view(shape)


class _WeightOnlyLinear(nn.Module):
    """y = x @ W.T + bias with W stored quantized: the kernel up to `kernel_max_tokens`
    tokens, a dense product with the dequantized W above (see the module docstring)."""

    kernel_max_tokens: int
    bias: Tensor | None  # buffer

    def __init__(self, bias: Tensor | None, dtype: torch.dtype, scratch: DequantScratch) -> None:
        super().__init__()
        self.register_buffer("bias", None if bias is None else bias.detach().to(dtype))
        self.scratch = scratch

    def kernel(self, x: Tensor) -> Tensor:
        """x [tokens, in] @ W.T through torch's quantized kernel."""
        raise NotImplementedError

    def dense(self, x: Tensor) -> Tensor:
        """x [tokens, in] @ W.T as a dense product over W dequantized into the scratch buffer."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        y = self.kernel(flat) if flat.shape[0] <= self.kernel_max_tokens else self.dense(flat)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], -1)


class Int8Linear(_WeightOnlyLinear):
    """W = q * scales[:, None], q int8 [out, in] (one scale per output channel)."""

    kernel_max_tokens = 32  # measured crossover with dequantize + bf16 product: 32-48 tokens
    qweight: Tensor  # buffers
    scales: Tensor

    def __init__(
        self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, scratch: DequantScratch
    ) -> None:
        super().__init__(bias, dtype, scratch)
        q, scales = quantize_int8(weight)
        self.register_buffer("qweight", q)
        self.register_buffer("scales", scales.to(dtype))

    def rows(self, index: Tensor) -> Int8Linear:
        """A layer of output rows `index` of this one: the same int8 values, scales and kernels
        (a reduced draft vocabulary's head; not quantized again)."""
        layer = Int8Linear.__new__(Int8Linear)
        bias = None if self.bias is None else self.bias[index]
        _WeightOnlyLinear.__init__(layer, bias, self.scales.dtype, self.scratch)
        layer.register_buffer("qweight", self.qweight[index].contiguous())
        layer.register_buffer("scales", self.scales[index].contiguous())
        return layer

    def kernel(self, x: Tensor) -> Tensor:
        return torch._weight_int8pack_mm(x, self.qweight, self.scales)

    def dense(self, x: Tensor) -> Tensor:
        # q converts exactly (|q| <= 127 fits any float mantissa); the scales apply to the
        # outputs, as the kernel applies them: one pass over the weights instead of two
        rows, cols = self.qweight.shape
        q = self.scratch.take((rows, cols), self.scales.dtype).copy_(self.qweight)
        return (x @ q.t()).mul_(self.scales)


def check_int4_shapes(shapes: list[tuple[int, ...]], group_size: int) -> None:
    """ValueError unless torch's int4 CPU kernel takes weights of these [out, in] shapes."""
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    for rows, cols in shapes:
        if rows % INT4_ROW_MULTIPLE or cols % group_size:
            raise ValueError(
                f"int4 needs output rows in multiples of {INT4_ROW_MULTIPLE} and inputs in "
                f"multiples of the group size {group_size}, got a [{rows}, {cols}] weight "
                "(use int8 for this model)"
            )


class Int4Linear(_WeightOnlyLinear):
    """W = (q - 8) * scale + zero per group of `group_size` inputs, q in 0..15.

    The nibble copy for the dequantized path is stored transposed, [in / 2, out] (inputs 2j
    and 2j + 1 in the low and high nibble): its scales then broadcast along contiguous rows of
    outputs, 2.4x faster to dequantize than along groups of 32 inputs (measured), and W.T is
    what the dense product takes.
    """

    kernel_max_tokens = 64  # measured crossover with dequantize + bf16 product: about 64
    packed: Tensor  # buffers
    scales_and_zeros: Tensor
    nibbles_t: Tensor
    scales_t: Tensor
    offsets_t: Tensor

    def __init__(
        self,
        weight: Tensor,
        bias: Tensor | None,
        dtype: torch.dtype,
        scratch: DequantScratch,
        group_size: int = 32,
    ) -> None:
        super().__init__(bias, dtype, scratch)
        check_int4_shapes([tuple(weight.shape)], group_size)
        q, scales, zeros = quantize_int4(weight, group_size)
        self.group_size = group_size
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.int(), 1))
        # the kernel's [groups, out, 2] table of (scale, zero)
        table = torch.stack((scales.t(), zeros.t()), dim=-1).to(dtype).contiguous()
        self.register_buffer("scales_and_zeros", table)
        q_t = q.t()
        self.register_buffer("nibbles_t", (q_t[0::2] | (q_t[1::2] << 4)).contiguous())
        # dequantized from the kernel's (rounded) table: w = q * scale + (zero - 8 * scale),
        # each [groups, 1, out]
        scale, zero = table.float()[:, None].unbind(-1)
        self.register_buffer("scales_t", scale.to(dtype).contiguous())
        self.register_buffer("offsets_t", (zero - 8.0 * scale).to(dtype).contiguous())

    def kernel(self, x: Tensor) -> Tensor:
        return torch._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )

    def dense(self, x: Tensor) -> Tensor:
        return x @ self.dequantized_t()

    def dequantized_t(self) -> Tensor:
        """W.T [in, out] in the activations' dtype, in the shared scratch buffer."""
        half, rows = self.nibbles_t.shape
        out = self.scratch.take((2 * half, rows), self.scales_t.dtype)
        pairs = out.view(half, 2, rows)
        pairs[:, 0].copy_(self.nibbles_t & 15)
        pairs[:, 1].copy_(self.nibbles_t >> 4)
        out.view(-1, self.group_size, rows).mul_(self.scales_t).add_(self.offsets_t)
        return out


_PROJECTIONS = ("qkv", "attn_out", "mlp_in", "mlp_out")


def quantize_model(
    model: Transformer, kind: str, group_size: int = 32, calibration: Tensor | None = None
) -> None:
    """Replace, in place, the block projections of a loaded `Transformer` by `kind` ("int8",
    "int4" or "w8a8") layers and its output matrix by an int8 one (w8a8: a w8a8 one); the
    model's float weights (in the activations' dtype) are dropped as each is replaced.
    `calibration` [tokens] (w8a8 only): the ids whose activations the smoothing and outlier
    channels are fitted to (`avspec.runtime.w8a8`; None: the plain kernel). CPU only."""
    if kind not in WEIGHT_KINDS:
        raise ValueError(f"weight quantization must be one of {WEIGHT_KINDS}, got {kind!r}")
    dtype = model.embed.weight.dtype
    if model.embed.weight.device.type != "cpu":
        raise ValueError(f"{kind} runs on torch's CPU kernels: load the model on the CPU")
    projections = [getattr(block, name) for block in model.blocks for name in _PROJECTIONS]
    if kind == "int4":
        check_int4_shapes([tuple(p.weight.shape) for p in projections], group_size)
    # w8a8: each layer's calibrated input maxima (the head's input is final_norm's output)
    maxima: dict = {}
    if kind == "w8a8" and calibration is not None:
        maxima = input_maxima(model, projections, calibration)
    scratch = DequantScratch()

    def layer(
        linear: nn.Linear | _TiedHead, weight_kind: str, input_max: Tensor | None
    ) -> nn.Module:
        if weight_kind == "int4":
            return Int4Linear(linear.weight, linear.bias, dtype, scratch, group_size)
        if weight_kind == "w8a8":
            return W8A8Linear.calibrated(linear.weight, linear.bias, dtype, input_max)
        return Int8Linear(linear.weight, linear.bias, dtype, scratch)

    with torch.no_grad():
        for block in model.blocks:
            for name in _PROJECTIONS:
                linear = getattr(block, name)
                setattr(block, name, layer(linear, kind, maxima.get(linear)))
        untied = cast(nn.Linear | None, model.lm_head)  # a float model's: not quantized yet
        head = untied if untied is not None else _TiedHead(model.embed.weight)
        head_kind = "w8a8" if kind == "w8a8" else "int8"
        model.lm_head = layer(head, head_kind, maxima.get(model.final_norm))


class _TiedHead:
    """The tied output matrix seen as a bias-free linear layer (for quantizing it)."""

    def __init__(self, weight: Tensor) -> None:
        self.weight, self.bias = weight, None
