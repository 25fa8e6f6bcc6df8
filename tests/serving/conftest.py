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

import pytest
from helpers.server import (
    ADMIN_KEY,
    MAX_LENGTH,
    REFIT_INTERVAL,
    REPOSITORY,
    save_tiny_pair,
    stage_overrides,
    write_steep_draft_costs,
)

from avspec.serving.repository import build_test_repository
from avspec.serving.server_process import ServerProcess, free_port


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.serving)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The running server; its log is in the tmp dir and printed if it fails to start."""
    tmp = tmp_path_factory.mktemp("serving")
    target_dir, draft_dir = save_tiny_pair(tmp / "models")
    repository = build_test_repository(
        REPOSITORY,
        tmp / "model_repository",
        {
            "draft": stage_overrides(draft_dir),
            "target": stage_overrides(target_dir),
            "verifier": {
                "refit_interval": REFIT_INTERVAL,
                "snapshot_path": tmp / "estimator_snapshot.json",
                "cost_tables": write_steep_draft_costs(tmp / "cost_tables.json"),
                "cost_refresh": "false",  # keep the steep tables: the refresh would follow
                # this machine, where the tiny draft's pass costs well under a millisecond
            },
            "speculative": {"max_batch_size": 32, "max_context": MAX_LENGTH},
        },
    )
    log = tmp / "tritonserver.log"
    process = ServerProcess(
        repository,
        free_port(),
        free_port(),
        free_port(),
        exit_timeout_s=5,
        log_path=log,
        admin_key=ADMIN_KEY,
    )
    try:
        process.start()
    except Exception:
        print(log.read_text()[-6000:])
        raise
    process.snapshot_path = tmp / "estimator_snapshot.json"
    yield process
    process.stop()
