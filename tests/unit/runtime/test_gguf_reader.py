"""`avspec.runtime.gguf.reader`: every supported storage type read back from a tiny GGUF.

Each file is written with ggml's `gguf.GGUFWriter`: one [3, 256] tensor, quantized by
`gguf.quants.quantize` (F16, BF16, Q8_0, Q4_0, Q4_1) or laid out block by block here for the
K types the package can only dequantize (Q4_K, Q6_K, with integer-valued rows so the expected
values are exact). Read back by `GGUFFile.tensor`, each must have the row-major shape (the
stored dimensions reversed) and the original values within the type's rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers.gguf_files import write_tensor_gguf

from avspec.runtime.gguf.reader import GGUFError, GGUFFile

ROWS, COLS = 3, 256


def _smooth() -> np.ndarray:
    gen = np.random.default_rng(0)
    return gen.normal(size=(ROWS, COLS)).astype(np.float32)


def _integers(low: int, high: int) -> np.ndarray:
    """Rows of integers in [low, high] times a per-row scale (exact in Q4_K / Q6_K)."""
    gen = np.random.default_rng(1)
    ints = gen.integers(low, high + 1, size=(ROWS, COLS)).astype(np.float32)
    ints[:, 0], ints[:, 1] = low, high  # so each row's max |value| fixes its scale
    return ints * np.array([[0.5], [0.25], [2.0]], dtype=np.float32)


# (type, values, tolerance relative to the row's largest |value|)
CASES = [
    (Q.F32, _smooth(), 0.0),
    (Q.F16, _smooth(), 1e-3),
    (Q.BF16, _smooth(), 8e-3),
    (Q.Q8_0, _smooth(), 1e-2),
    (Q.Q4_0, _smooth(), 0.15),
    (Q.Q4_1, _smooth(), 0.15),
    (Q.Q4_K, _integers(0, 15), 1e-6),
    (Q.Q6_K, _integers(-32, 31), 1e-6),
]


@pytest.mark.parametrize(("kind", "values", "tolerance"), CASES, ids=[c[0].name for c in CASES])
def test_each_type_reads_back(tmp_path, kind, values, tolerance):
    path = write_tensor_gguf(tmp_path / "t.gguf", values, kind)
    gguf = GGUFFile(path)
    assert gguf.tensor_type("t") == kind.name
    got = gguf.tensor("t")
    assert got.dtype == torch.float32 and tuple(got.shape) == (ROWS, COLS)
    scale = np.abs(values).max(axis=1, keepdims=True)
    error = np.abs(got.numpy() - values) / scale
    assert error.max() <= tolerance, f"{kind.name}: max relative error {error.max():.4f}"
    # the rows are distinguishable: a transposed or reshaped read would mix the row scales
    assert not torch.allclose(got[0], got[1])


def test_k_types_are_not_trivially_equal(tmp_path):
    """The hand-made K blocks decode to the intended integers, not to zeros or a constant."""
    values = _integers(0, 15)
    got = GGUFFile(write_tensor_gguf(tmp_path / "k.gguf", values, Q.Q4_K)).tensor("t")
    assert len(torch.unique(got[0])) == 16


def test_missing_metadata_and_tensor_are_named(tmp_path):
    gguf = GGUFFile(write_tensor_gguf(tmp_path / "t.gguf", _smooth(), Q.F32))
    with pytest.raises(GGUFError, match="llama.block_count"):
        gguf.value("llama.block_count")
    assert gguf.value("llama.block_count", 7) == 7
    with pytest.raises(GGUFError, match="'nope'"):
        gguf.tensor("nope")


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "x.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="not a readable GGUF"):
        GGUFFile(path)
