"""How to run a tritonserver, without one: backend directory, environment, the two kinds of
server (avspec.serving.host.triton_env)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.fake_tritonserver import fake_tritonserver

from avspec.serving.host.triton_env import (
    BACKEND_SOURCE_DIR,
    TritonInstall,
    prepare_backend_directory,
    server_environment,
    tritonserver_binary,
)


def test_backend_directory_holds_python_backend(tmp_path: Path) -> None:
    python = prepare_backend_directory(tmp_path) / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        assert (python / name).is_file()
    assert os.access(python / "triton_python_backend_stub", os.X_OK)


def test_server_environment() -> None:
    env = server_environment({"PATH": "/usr/bin"}, cpu_threads=1)
    assert env["OMP_NUM_THREADS"] == "1"
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    assert env["PATH"].endswith(":/usr/bin")
    assert str(BACKEND_SOURCE_DIR) in env["PYTHONPATH"]
    assert "OMP_NUM_THREADS" not in server_environment({}, cpu_threads=None)


MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1048576",
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
    "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "64",
    "LRU_CACHE_CAPACITY": "128",
}


def test_installed_server_keeps_its_environment_but_the_thread_cap_and_malloc() -> None:
    """Another tritonserver (the NGC image's) has its own python3 and PYTHONPATH: kept as is."""
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/opt/avspec/backend", "LD_LIBRARY_PATH": "/x"}
    threads = {"OMP_NUM_THREADS": "1"}
    assert server_environment(base, cpu_threads=1, bundled=False) == base | threads | MALLOC_ENV
    assert server_environment(base, cpu_threads=None, bundled=False) == base | MALLOC_ENV


def test_malloc_settings_reach_every_server_and_yield_to_the_operators() -> None:
    """Fixed mmap threshold + huge pages against heap fragmentation in the stage stubs, and a
    small oneDNN kernel cache (one kernel per gelu input shape) and a small cache of torch's bf16
    matmuls (new entries for each token count)."""
    for bundled in (True, False):
        env = server_environment({"PATH": "/usr/bin"}, bundled=bundled)
        assert {k: env[k] for k in MALLOC_ENV} == MALLOC_ENV
    mine = {
        "MALLOC_MMAP_THRESHOLD_": "65536",
        "GLIBC_TUNABLES": "glibc.malloc.arena_max=2",
        "ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0",
        "LRU_CACHE_CAPACITY": "1024",
    }
    env = server_environment(mine, bundled=False)
    assert env["MALLOC_MMAP_THRESHOLD_"] == "65536"
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "0"
    assert env["LRU_CACHE_CAPACITY"] == "1024"
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    off = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}
    assert server_environment(off, bundled=False)["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=0"


def test_triton_install_tells_the_wheel_server_from_an_installed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = TritonInstall.find()
    assert wheel.binary == tritonserver_binary() and wheel.bundled and wheel.assembles_backends
    assert TritonInstall.find(tritonserver_binary()).bundled
    binary = fake_tritonserver(tmp_path)
    monkeypatch.setenv("PATH", f"{binary.parent}:/usr/bin:/bin")
    installed = TritonInstall.find("tritonserver")  # a bare name: looked up on PATH
    assert installed.binary == binary.resolve() and not installed.bundled
    assert not installed.assembles_backends  # tritonserver's own default backend directory
    assert TritonInstall.find(binary, tmp_path).backend_directory == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        TritonInstall.find(binary, tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no 'no-such-server' on PATH"):
        TritonInstall.find("no-such-server")
