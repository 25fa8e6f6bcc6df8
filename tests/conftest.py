"""Fixtures shared across test folders (helpers without fixtures live in tests/helpers/)."""

from __future__ import annotations

import pytest
import torch
from helpers.ci import MISSING_TOOL


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models run far faster on one thread on a loaded 2-core machine (and need no grad).

    A module opts in with `pytestmark = pytest.mark.usefixtures("single_thread")`.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with torch.no_grad():
        yield
    torch.set_num_threads(threads)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """At the end of a local run, say which tests were skipped for a missing tool and how to
    run them (in CI a missing tool fails instead: tests/helpers/ci.py)."""
    reasons = []
    for report in terminalreporter.stats.get("skipped", []):
        reason = str(report.longrepr[2] if isinstance(report.longrepr, tuple) else "")
        if MISSING_TOOL in reason:
            reasons.append(f"{report.nodeid.split('::')[0]}: {reason.removeprefix('Skipped: ')}")
    if reasons:
        terminalreporter.section("skipped: tools missing on this machine")
        for line in sorted(set(reasons)):
            terminalreporter.write_line(line)
