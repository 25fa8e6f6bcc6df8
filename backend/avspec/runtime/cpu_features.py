"""Which CPU instructions this machine has, read from /proc/cpuinfo's `flags` line.

bfloat16 matrix products are fast on a CPU only with native bf16 dot products: `avx512_bf16`
(AVX-512 BF16, Intel Cooper Lake and later, AMD Zen 4 and later) or `amx_bf16` (Intel AMX tiles,
Sapphire Rapids and later). Without them torch emulates bf16 through float32 conversions and a
bf16 model runs slower than float32, so the `auto` serving precision
(`avspec.runtime.precision`) picks bfloat16 only where one of these flags is present.
"""

from __future__ import annotations

from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# int8 dot products that accumulate in int32 (AVX-512 VNNI, AMX): FBGEMM's int8 GEMM needs them
# to take full 8-bit activations; without them it multiplies u8 x s8 pairs into saturating int16
# sums (vpmaddubsw), so activations must keep to 7 bits (`avspec.runtime.w8a8`).
INT8_DOT_FLAGS = ("avx512_vnni", "amx_int8")


def parse_cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor listed in /proc/cpuinfo text (x86: `flags`, ARM:
    `Features`); empty when there is no such line."""
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """This machine's CPU flags; empty if `path` cannot be read (not Linux)."""
    try:
        return parse_cpu_flags(path.read_text(errors="replace"))
    except OSError:
        return frozenset()


def has_fast_bf16(flags: frozenset[str]) -> bool:
    """Whether `flags` include native bfloat16 dot products (one of BF16_FLAGS)."""
    return any(flag in flags for flag in BF16_FLAGS)


def has_int8_dot(flags: frozenset[str]) -> bool:
    """Whether `flags` include int8 dot products into int32 (one of INT8_DOT_FLAGS)."""
    return any(flag in flags for flag in INT8_DOT_FLAGS)
