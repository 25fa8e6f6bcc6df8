"""Serving precisions: what a stage's `dtype` parameter names, and loading a model in one.

A precision fixes the activations' dtype (also the KV cache's and the unquantized weights') and
whether the block and output matrices are stored as weight-only int8 or int4
(`avspec.runtime.quantized`):

- `float32`, `bfloat16`, `float16`: every weight and activation in that dtype;
- `auto`: bfloat16 where the CPU multiplies it natively (`avspec.runtime.cpu_features`), else
  float32, decided and logged once per process; on a GPU bfloat16 where supported;
- `int8`, `int4` (CPU only): those weights quantized at load, activations as `auto` picks;
- `w8a8` (CPU only): int8 weights and each product's activations quantized to int8 on the fly
  (FBGEMM's int8 GEMM); the other activations as `auto` picks.

A quantized target is a slightly different model from the checkpoint's (bfloat16 is too, less
so): exactness against `transformers` is stated and tested in float32, the precisions are
compared with it by `client/bench_runtime.py --accuracy`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from avspec.runtime.cpu_features import BF16_FLAGS, has_fast_bf16, read_cpu_flags
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.quantized import WEIGHT_KINDS, quantize_model
from avspec.runtime.transformer import Transformer
from avspec.runtime.w8a8 import calibration_ids

logger = logging.getLogger(__name__)

FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PRECISIONS = (*FLOAT_DTYPES, "auto", *WEIGHT_KINDS)


@dataclass(frozen=True)
class Precision:
    """A resolved serving precision: `dtype` of activations, `weights` "int8"/"int4"/"w8a8" or
    None."""

    name: str
    dtype: torch.dtype
    weights: str | None = None

    def __str__(self) -> str:
        activations = str(self.dtype).removeprefix("torch.")
        if self.weights == "w8a8":
            return f"int8 weights, int8 dynamic activations in products, {activations} elsewhere"
        if self.weights is not None:
            return f"{self.weights} weights, {activations} activations"
        return f"{activations} (auto)" if self.name == "auto" else activations


def resolve_precision(name: str, device: str | torch.device = "cpu") -> Precision:
    """The `Precision` a stage's `dtype` value `name` means on `device`; ValueError for an
    unknown name or int8/int4/w8a8 off the CPU."""
    kind = torch.device(device).type
    if name in FLOAT_DTYPES:
        return Precision(name, FLOAT_DTYPES[name])
    if name == "auto":
        return Precision(name, auto_dtype(kind))
    if name in WEIGHT_KINDS:
        if kind != "cpu":
            raise ValueError(f"dtype {name!r} uses torch's CPU kernels; device is {device}")
        return Precision(name, auto_dtype(kind), name)
    raise ValueError(f"dtype must be one of {', '.join(PRECISIONS)}, got {name!r}")


def auto_dtype(device_type: str = "cpu") -> torch.dtype:
    """bfloat16 where `device_type` computes it natively, else float32."""
    if device_type == "cpu":
        return _cpu_auto_dtype()
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32


@functools.cache
def _cpu_auto_dtype() -> torch.dtype:
    flags = read_cpu_flags()
    if has_fast_bf16(flags):
        found = " and ".join(flag for flag in BF16_FLAGS if flag in flags)
        logger.info("precision auto: bfloat16 (the CPU has %s)", found)
        return torch.bfloat16
    logger.info("precision auto: float32 (neither %s in /proc/cpuinfo)", " nor ".join(BF16_FLAGS))
    return torch.float32


def load_served_model(
    path: Path | str,
    device: str | torch.device,
    precision: str,
    max_length: int | None = None,
    group_size: int = 32,
) -> Transformer:
    """`avspec.runtime.model_dir.load_model` in `precision` (a `PRECISIONS` name), quantized
    at load for int8/int4/w8a8 (`group_size`: int4's inputs per scale; w8a8 calibrated on
    `avspec.runtime.w8a8.CALIBRATION_TEXT` in the model's tokenizer)."""
    spec = resolve_precision(precision, device)
    model = load_model(path, device, dtype=spec.dtype, max_length=max_length)
    if spec.weights is not None:
        calibration = None
        if spec.weights == "w8a8":  # fitted to the model's own reading of a fixed text
            calibration = calibration_ids(load_tokenizer(path).encode)
        quantize_model(model, spec.weights, group_size, calibration)
    return model
