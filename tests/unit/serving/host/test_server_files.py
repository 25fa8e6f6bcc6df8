"""What the server's user may read and write (avspec.serving.host.server_files)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from avspec.serving.host.sandbox import ServerUser
from avspec.serving.host.server_files import grant_writable, server_files, unreadable

USER = ServerUser(10001, 10001)


def _repository(root: Path) -> Path:
    model = root / "model_repository" / "verifier"
    model.mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\n'
        'parameters { key: "model_dir" value: { string_value: "models/target" } }\n'
        'parameters { key: "cost_tables" value: { string_value: "/abs/costs.json" } }\n'
        'parameters { key: "snapshot_path" value: { string_value: "runs/snap.json" } }\n'
        'parameters { key: "refit_interval" value: { string_value: "10" } }\n'
    )
    return root / "model_repository"


def test_path_parameters_resolve_against_the_project_root(tmp_path: Path) -> None:
    repository = _repository(tmp_path)
    files = server_files([repository], {"verifier": repository}, None)
    # parameters in key order: cost_tables before model_dir
    assert files.readable == (repository, Path("/abs/costs.json"), tmp_path / "models" / "target")
    assert files.writable == (tmp_path / "runs",)


@pytest.mark.skipif(os.geteuid() != 0, reason="chown and su need root")
def test_only_the_snapshot_directory_is_given_and_reads_are_checked_as_the_user(
    tmp_path: Path,
) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "snap.json").write_text("{}")
    grant_writable([runs], USER)
    assert (runs.stat().st_uid, (runs / "snap.json").stat().st_uid) == (USER.uid, USER.uid)
    assert tmp_path.stat().st_uid == 0  # nothing above it
    readable, secret = tmp_path / "models", tmp_path / "secret.key"
    readable.mkdir()
    secret.write_text("k")
    secret.chmod(0o600)
    tmp_path.chmod(0o700)  # views make the way in; the files' own modes still count
    assert unreadable([readable, secret], USER, [readable, secret], []) == [str(secret)]


def test_without_a_user_to_drop_to_reads_are_checked_as_this_process(tmp_path: Path) -> None:
    """The same rule as for the server's user: a directory must be listable and enterable."""
    closed = tmp_path / "closed"
    closed.mkdir()
    closed.chmod(0o600)  # listable, not enterable
    try:
        expected = [] if os.geteuid() == 0 else [str(closed)]  # root passes every check
        assert unreadable([closed, tmp_path / "absent"], None) == expected
    finally:
        closed.chmod(0o700)
