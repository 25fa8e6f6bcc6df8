"""`engine: auto`: torch where the CPU has native bfloat16, llama.cpp's engine elsewhere when the
GGUF files and the binding are there, torch otherwise; each choice says why."""

from __future__ import annotations

from pathlib import Path

import pytest

import avspec.runtime.llamacpp.binding as binding
from avspec.runtime.engine_choice import choose_engine

AVX2 = frozenset({"avx2", "fma"})
BF16 = AVX2 | {"avx512f", "avx512_bf16"}


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    paths = [tmp_path / "draft.gguf", tmp_path / "target.gguf"]
    for path in paths:
        path.write_bytes(b"GGUF")
    return paths


def test_native_bf16_serves_torch(files) -> None:
    assert choose_engine(files, BF16)[0] == "torch"
    assert choose_engine(files, AVX2 | {"amx_bf16"})[0] == "torch"


def test_without_bf16_llamacpp_serves_when_it_can(files, monkeypatch) -> None:
    monkeypatch.setattr(binding, "llama_cpp", lambda: object())
    engine, why = choose_engine(files, AVX2)
    assert engine == "llamacpp" and "no bfloat16" in why


def test_without_bf16_and_without_a_gguf_torch_serves(files, monkeypatch) -> None:
    monkeypatch.setattr(binding, "llama_cpp", lambda: object())
    files[1].unlink()
    engine, why = choose_engine(files, AVX2)
    assert engine == "torch" and str(files[1]) in why


def test_without_bf16_and_without_the_binding_torch_serves(files, monkeypatch) -> None:
    def unavailable():
        raise binding.EngineUnavailable("run `make llamacpp`")

    monkeypatch.setattr(binding, "llama_cpp", unavailable)
    engine, why = choose_engine(files, AVX2)
    assert engine == "torch" and "make llamacpp" in why
