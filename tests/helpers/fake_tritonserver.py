"""A stand-in tritonserver executable (a shell script that does nothing) for tests that only
need one to be found and run."""

from __future__ import annotations

from pathlib import Path


def fake_tritonserver(directory: Path) -> Path:
    binary = directory / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary
