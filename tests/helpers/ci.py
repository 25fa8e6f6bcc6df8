"""Tests that need a tool this machine may lack (nginx, Helm's engine): skipped locally with the
way to run them, failed in CI (AVSPEC_CI=1, set by .ci/run, which installs every tool)."""

from __future__ import annotations

import os

import pytest

MISSING_TOOL = "needs a tool"  # the mark tests/conftest.py looks for in skip reasons


def in_ci() -> bool:
    return os.environ.get("AVSPEC_CI") == "1" or os.environ.get("CI") == "true"


def missing_tool(message: str, how: str) -> None:
    """Fail in CI; skip elsewhere, saying what is missing and how to get it (`how`)."""
    if in_ci():
        pytest.fail(f"{message}; .ci/run installs it")
    pytest.skip(f"{MISSING_TOOL}: {message}; to run it: {how}")
