"""The llama.cpp build key: one per CPU and build recipe, AMX kernels left out where they exist."""

from avspec.runtime.llamacpp import binding
from avspec.runtime.llamacpp.binding import NO_AMX, build_key, compiler_flags, cpu_key

AVX512 = frozenset({"avx2", "avx512f", "avx512_vnni", "avx512_bf16"})
AMX = AVX512 | {"amx_tile", "amx_int8", "amx_bf16"}


def test_amx_kernels_are_left_out_only_where_the_cpu_has_them() -> None:
    assert compiler_flags(AVX512) == ""
    assert compiler_flags(AMX) == NO_AMX
    assert "-mno-amx-int8" in NO_AMX  # ggml's AMX matmul needs __AMX_INT8__


def test_the_build_key_names_the_cpu_and_changes_with_the_recipe(monkeypatch) -> None:
    assert build_key(AMX).startswith(cpu_key(AMX) + "-")
    assert build_key(AMX) != build_key(AVX512)
    before = build_key(AVX512)
    monkeypatch.setattr(binding, "CMAKE_ARGS", binding.CMAKE_ARGS + " -DGGML_AMX_INT8=ON")
    assert build_key(AVX512) != before  # a changed recipe never reuses an older wheel
