"""CPU feature detection from /proc/cpuinfo text, and the `auto` precision it decides."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from avspec.runtime import precision
from avspec.runtime.cpu_features import has_fast_bf16, parse_cpu_flags, read_cpu_flags

# Abridged from real machines: an AMD EPYC (Zen 4) with AVX-512 BF16, an Intel Skylake server
# without it (its `vmx flags` line must not be read as the flags), a Sapphire Rapids with AMX,
# and an ARM server (`Features`).
ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi
bugs\t\t: sysret_ss_attrs spectre_v1

processor\t: 1
flags\t\t: fpu vme avx2 avx512f avx512bw avx512_vnni avx512_bf16 avx512vbmi
"""
SKYLAKE = """processor\t: 0
vendor_id\t: GenuineIntel
flags\t\t: fpu vme avx2 avx512f avx512bw avx512vl avx512_vnni
vmx flags\t: vnmi preemption_timer avx512_bf16 posted_intr
"""
SAPPHIRE_RAPIDS = """processor\t: 0
flags\t\t: fpu avx512f avx512_vnni amx_bf16 amx_tile amx_int8 avx512_fp16
"""
ARM = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics bf16 i8mm
"""


@pytest.mark.parametrize(
    ("text", "fast"),
    [(ZEN4, True), (SKYLAKE, False), (SAPPHIRE_RAPIDS, True), (ARM, False), ("", False)],
    ids=["zen4", "skylake", "sapphire_rapids", "arm", "empty"],
)
def test_bf16_detection_from_cpuinfo(text, fast):
    assert has_fast_bf16(parse_cpu_flags(text)) is fast


def test_flags_are_whole_words_of_the_flags_line():
    flags = parse_cpu_flags(ZEN4)
    assert "avx512_bf16" in flags and "avx512f" in flags and "sysret_ss_attrs" not in flags
    assert "avx512_bf16" not in parse_cpu_flags(SKYLAKE)  # only in `vmx flags`
    assert "bf16" in parse_cpu_flags(ARM)  # ARM's bf16 is not an x86 flag: not fast here
    assert not has_fast_bf16(frozenset({"avx512_bf16x", "xamx_bf16"}))


def test_unreadable_cpuinfo_means_no_flags(tmp_path: Path):
    assert read_cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "cpuinfo").write_text(SAPPHIRE_RAPIDS)
    assert "amx_bf16" in read_cpu_flags(tmp_path / "cpuinfo")


@pytest.mark.parametrize(("text", "dtype"), [(ZEN4, torch.bfloat16), (SKYLAKE, torch.float32)])
def test_auto_precision_follows_the_flags_and_is_logged_once(monkeypatch, caplog, text, dtype):
    monkeypatch.setattr(precision, "read_cpu_flags", lambda: parse_cpu_flags(text))
    precision._cpu_auto_dtype.cache_clear()
    try:
        with caplog.at_level("INFO", logger="avspec.runtime.precision"):
            first = precision.resolve_precision("auto", "cpu")
            int4 = precision.resolve_precision("int4", "cpu")
        assert first.dtype == dtype and first.weights is None
        assert int4.dtype == dtype and int4.weights == "int4"
        assert str(first) == f"{str(dtype).removeprefix('torch.')} (auto)"
        assert len([r for r in caplog.records if "precision auto" in r.message]) == 1
    finally:
        precision._cpu_auto_dtype.cache_clear()
