"""Read a GGUF file with ggml's `gguf` package: metadata values and dequantized tensors.

The file is memory-mapped by `gguf.GGUFReader`; nothing is parsed here by hand. A tensor is
dequantized to float32 by the package's own `gguf.quants.dequantize`, which covers the float
types (F32, F16, BF16), the 32-value block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and the
256-value "K" super-blocks (Q2_K ... Q6_K) among others; a type it cannot dequantize raises
`GGUFError` naming the tensor and the type.

Shapes: GGUF lists a tensor's dimensions fastest-varying first (ggml's `ne`), so a
[out_features, in_features] PyTorch weight is stored with shape (in_features, out_features).
`GGUFFile.tensor` returns the row-major (PyTorch) shape, i.e. the stored dimensions reversed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

_MISSING: Any = object()


class GGUFError(ValueError):
    """A GGUF file is unreadable, lacks a field or tensor, or holds something unsupported."""


class GGUFFile:
    """One GGUF file opened read-only: its metadata and tensors, by name."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            self._reader = GGUFReader(self.path, "r")
        except (OSError, ValueError, IndexError, KeyError) as err:  # IndexError: cut short
            raise GGUFError(
                f"{self.path}: not a readable GGUF file (truncated or not GGUF): "
                f"{type(err).__name__}: {err}"
            ) from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    @property
    def architecture(self) -> str:
        """`general.architecture`: llama.cpp's name of the model family ("llama", "qwen2", ...)."""
        value = self.value("general.architecture")
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: general.architecture is {value!r}, not a string")
        return value

    def has(self, key: str) -> bool:
        """Whether the metadata holds `key`."""
        return key in self._reader.fields

    def value(self, key: str, default: Any = _MISSING) -> Any:
        """The metadata value of `key` (a scalar, a string or a list); GGUFError if missing and
        no default is given."""
        field = self._reader.fields.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: metadata {key!r} is missing")
            return default
        return field.contents()

    def tensor_names(self) -> list[str]:
        """Names of every tensor, in file order."""
        return list(self._tensors)

    def tensor_type(self, name: str) -> str:
        """The stored type's name of tensor `name` ("F32", "Q4_1", ...)."""
        return self._info(name).tensor_type.name

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Row-major (PyTorch) shape of tensor `name`: the GGUF dimensions reversed."""
        return tuple(int(n) for n in reversed(self._info(name).shape.tolist()))

    def tensor(self, name: str) -> torch.Tensor:
        """Tensor `name` dequantized to float32, in its row-major (PyTorch) shape."""
        info = self._info(name)
        kind = GGMLQuantizationType(int(info.tensor_type))
        try:
            values = dequantize(np.asarray(info.data), kind)
        except NotImplementedError:
            raise GGUFError(
                f"{self.path}: tensor {name!r} is stored as {kind.name}, which the gguf package "
                "cannot dequantize"
            ) from None
        shape = self.tensor_shape(name)
        # a copy: the file's mapping is read-only and must not back a tensor
        return torch.from_numpy(np.array(values, dtype=np.float32).reshape(shape))

    def _info(self, name: str) -> Any:
        info = self._tensors.get(name)
        if info is None:
            raise GGUFError(f"{self.path}: tensor {name!r} is missing")
        return info
