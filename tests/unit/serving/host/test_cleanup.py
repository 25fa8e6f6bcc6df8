"""Tests for avspec.serving.host.cleanup: leftovers of crashed Triton Python backends.

A tmp directory stands in for /dev/shm and another for /tmp; liveness and mappings are real
(/proc of this machine): a reaped child gives a dead pid, an mmap in this process a live user.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from avspec.serving.host import cleanup
from avspec.serving.host.cleanup import (
    LEGACY_SHM_PREFIX,
    CleanupReport,
    clean_leftovers,
    shm_prefix,
    stale_env_dirs,
    stale_shm_regions,
)


@pytest.fixture(autouse=True)
def private_backend_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A library name of this test's own: real servers on this machine must not count."""
    monkeypatch.setattr(cleanup, "BACKEND_LIBRARY", f"libtriton_python_{tmp_path.name}.so")


@pytest.fixture
def dead_pid() -> int:
    """The pid of a child that has exited and been reaped (nothing runs under it now)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture
def zombie_pid() -> Iterator[int]:
    """The pid of a child that has exited but is not reaped yet (a zombie)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    stat = Path(f"/proc/{child.pid}/stat")
    deadline = time.monotonic() + 10
    while stat.read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline, "child did not exit"
        time.sleep(0.01)
    yield child.pid
    child.wait()


def region(directory: Path, name: str, size: int = 4096) -> Path:
    path = directory / name
    path.write_bytes(b"\0" * size)
    return path


def test_shm_prefix() -> None:
    assert shm_prefix(1234) == "avspec1234_"


def test_region_of_a_dead_launcher_is_stale_ours_is_kept(tmp_path: Path, dead_pid: int) -> None:
    dead = region(tmp_path, shm_prefix(dead_pid) + "1")
    region(tmp_path, shm_prefix(os.getpid()) + "1")
    region(tmp_path, "avspecexp_8446290b")  # another tool's prefix: not ours to judge
    region(tmp_path, "unrelated")
    assert stale_shm_regions(tmp_path) == [dead]


def test_region_of_a_zombie_launcher_is_stale(tmp_path: Path, zombie_pid: int) -> None:
    zombie = region(tmp_path, shm_prefix(zombie_pid) + "1")
    assert stale_shm_regions(tmp_path) == [zombie]


@contextlib.contextmanager
def mapped_without_descriptor(path: Path) -> Iterator[None]:
    """mmap `path` into this process and close the descriptor, as the backend's pool is held.

    Python's mmap module keeps a duplicate descriptor open, which would let a check of open
    files alone pass; libc's mmap does not.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size = path.stat().st_size
    fd = os.open(path, os.O_RDWR)
    try:
        address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    finally:
        os.close(fd)
    assert address not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
    try:
        yield
    finally:
        libc.munmap(address, size)


def test_legacy_region_mapped_by_a_live_process_is_kept(tmp_path: Path) -> None:
    mapped = region(tmp_path, LEGACY_SHM_PREFIX + "1")
    unmapped = region(tmp_path, LEGACY_SHM_PREFIX + "2")
    with mapped_without_descriptor(mapped):
        assert stale_shm_regions(tmp_path) == [unmapped]
    assert stale_shm_regions(tmp_path) == [mapped, unmapped]


def test_legacy_region_held_open_is_kept(tmp_path: Path) -> None:
    """Between shm_open and mmap a region is only an open descriptor: still in use."""
    held = region(tmp_path, LEGACY_SHM_PREFIX + "1")
    with held.open("rb"):
        assert stale_shm_regions(tmp_path) == []


def test_dead_pid_region_still_mapped_is_kept(tmp_path: Path, dead_pid: int) -> None:
    """A launcher killed with SIGKILL leaves tritonserver running: its regions are in use."""
    orphaned = region(tmp_path, shm_prefix(dead_pid) + "1")
    with mapped_without_descriptor(orphaned):
        assert stale_shm_regions(tmp_path) == []


def old_dir(path: Path, age_s: float = 3600) -> Path:
    path.mkdir()
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_stale_env_dirs_are_empty_and_old(tmp_path: Path) -> None:
    stale = old_dir(tmp_path / "python_env_AAAAAA")
    full = old_dir(tmp_path / "python_env_BBBBBB")
    (full / "env").write_text("x")
    os.utime(full, (time.time() - 3600,) * 2)
    (tmp_path / "python_env_CCCCCC").mkdir()  # young: may be a starting server's
    old_dir(tmp_path / "other_AAAAAA")
    (tmp_path / "python_env_file").write_text("")
    (tmp_path / "python_env_link").symlink_to(stale)
    assert stale_env_dirs(tmp_path, min_age_s=60) == [stale]
    assert stale_env_dirs(tmp_path, min_age_s=7200) == []


def test_env_dirs_kept_while_a_python_backend_runs(tmp_path: Path) -> None:
    """A live tritonserver's env dir stays empty all its life, and tritonserver aborts at exit
    if it is gone (fts_read error in ~EnvironmentManager): none is stale while one runs."""
    stale = old_dir(tmp_path / "python_env_AAAAAA")
    library = region(tmp_path, cleanup.BACKEND_LIBRARY)  # what a Python backend host maps
    with mapped_without_descriptor(library):
        assert stale_env_dirs(tmp_path, min_age_s=60) == []
    assert stale_env_dirs(tmp_path, min_age_s=60) == [stale]


def test_clean_leftovers_removes_and_reports(
    tmp_path: Path, dead_pid: int, caplog: pytest.LogCaptureFixture
) -> None:
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    region(shm, shm_prefix(dead_pid) + "1", size=1000)
    region(shm, LEGACY_SHM_PREFIX + "7", size=24)
    kept = region(shm, shm_prefix(os.getpid()) + "1")
    old_dir(tmp / "python_env_AAAAAA")
    with caplog.at_level(logging.INFO, logger=cleanup.__name__):
        report = clean_leftovers(shm, tmp, min_age_s=60)
    assert report == CleanupReport(shm_regions=2, shm_bytes=1024, env_dirs=1, errors=0)
    assert sorted(shm.iterdir()) == [kept] and list(tmp.iterdir()) == []
    assert len(caplog.records) == 1 and "2 stale shared-memory" in caplog.text


def test_clean_leftovers_logs_and_skips_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Permission errors (another user's file, a read-only mount) never raise."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir(), tmp.mkdir()
    first = region(shm, LEGACY_SHM_PREFIX + "1", size=10)
    region(shm, LEGACY_SHM_PREFIX + "2", size=20)
    env = old_dir(tmp / "python_env_AAAAAA")
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self == first:
            raise PermissionError(13, "Permission denied", str(self))
        real_unlink(self, missing_ok)

    def rmdir(path: object) -> None:
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(Path, "unlink", unlink)
    monkeypatch.setattr(cleanup.os, "rmdir", rmdir)
    with caplog.at_level(logging.INFO, logger=cleanup.__name__):
        report = clean_leftovers(shm, tmp, min_age_s=60)
    assert report == CleanupReport(shm_regions=1, shm_bytes=20, env_dirs=0, errors=2)
    assert sorted(shm.iterdir()) == [first] and env.is_dir()
    assert str(first) in caplog.text and str(env) in caplog.text


def test_clean_leftovers_missing_directories(tmp_path: Path) -> None:
    report = clean_leftovers(tmp_path / "no-shm", tmp_path / "no-tmp")
    assert report == CleanupReport()
