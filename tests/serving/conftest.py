"""One real Triton server per test session, on free ports, over a tmp copy of the repository.

The copy points the draft and target at a tiny seeded model pair saved in a tmp directory (the
target's weights plus small noise as the draft, so acceptance is partial), writes the estimator
snapshot to tmp and refits every 10 steps so the coefficients move within a few requests.
Its cost tables price a draft pass at 30 ms, far above a verified token, so the drafting plan
binds (shallow depth, requests stopped below their cap) even on this well-matched pair, and
the greedy identity test sees adaptive drafting actually change what is drafted (the online
refresh is off, or it would bring the tables back to this machine's times). Every test
that asks for `server` is marked `serving`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.server import readable_by_server, start_test_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serving)


@pytest.fixture(autouse=True)
def _readable_tmp_path(tmp_path: Path) -> None:
    """Let the server's user read what a test writes to tmp_path (pytest makes it 0700)."""
    readable_by_server(tmp_path)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The running server shared by the session (fault injection has its own: test_faults)."""
    process = start_test_server(readable_by_server(tmp_path_factory.mktemp("serving")))
    yield process
    process.stop()
