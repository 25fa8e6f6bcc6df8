"""Which runtime serves the stages when the operator does not say (`engine: auto`).

The rule, from served measurements (docs/benchmarks.md, "llama.cpp's engine"): on a CPU with
native bfloat16 dot products (avx512_bf16 or AMX, `cpu_features.has_fast_bf16`) the torch
runtime in bf16 computes 16 and more rows faster than ggml on the published 4-bit file and
costs the same for several tokens of a row as for one, so it serves there; without them torch
computes in float32 (an AVX2-only host, December 3: this server 8.6 / 36.5 tokens/s at
concurrency 1 / 16 where llama.cpp's server made 62.8 / 107.2 on the same file), so llama.cpp's
engine serves, when the model directories hold their GGUF and the binding is installed (`make
llamacpp`). `choose_engine` returns the engine and the reason, which the launcher prints.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from avspec.runtime.cpu_features import has_fast_bf16, read_cpu_flags


def choose_engine(
    gguf_files: Iterable[Path], flags: frozenset[str] | None = None
) -> tuple[str, str]:
    """(engine, why) for stages that would serve `gguf_files` on llama.cpp's engine."""
    flags = read_cpu_flags() if flags is None else flags
    if has_fast_bf16(flags):
        return "torch", "this CPU has native bfloat16 (avx512_bf16 or AMX): torch serves bf16"
    missing = [str(path) for path in gguf_files if not Path(path).is_file()]
    if missing:
        return "torch", f"no bfloat16 on this CPU, but no GGUF for llama.cpp: {', '.join(missing)}"
    from avspec.runtime.llamacpp.binding import EngineUnavailable, llama_cpp  # noqa: PLC0415

    try:
        llama_cpp()
    except EngineUnavailable as err:
        return "torch", f"no bfloat16 on this CPU, but llama.cpp's engine is unavailable: {err}"
    return "llamacpp", "no bfloat16 on this CPU: llama.cpp's engine serves the GGUF files"
