"""Tests for avspec.av.snapshot: versioned JSON save / restore of the estimator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from avspec.av import snapshot
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.snapshot import (
    FORMAT_NAME,
    FORMAT_VERSION,
    SnapshotError,
    load_snapshot,
    save_snapshot,
)
from avspec.config import EstimatorConfig

CONFIG = EstimatorConfig(num_positions=3, refit_interval=2)
ZERO_STATS = {name: [0.0, 0.0, 0.0] for name in ("A", "B", "C", "G0", "G1", "n")}


def _trained() -> AcceptanceEstimator:
    est = AcceptanceEstimator(CONFIG)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # two refits plus one open window
        f = torch.randn(16, 3, generator=gen)
        accepted = torch.randint(0, 4, (16,), generator=gen)
        est.observe(f, est.predict(f), torch.full((16,), 3), accepted)
        est.step()
    return est


def test_roundtrip(tmp_path: Path) -> None:
    est = _trained()
    path = tmp_path / "estimator.json"
    save_snapshot(est, path)
    back = load_snapshot(path, CONFIG, "cpu")
    assert back.slope.item() == pytest.approx(est.slope.item())
    torch.testing.assert_close(back.intercepts, est.intercepts)
    assert (back.num_steps, back.num_refits) == (5, 2)
    for name, value in est.stats.state_dict().items():
        torch.testing.assert_close(getattr(back.stats, name), value)
    document = json.loads(path.read_text())
    assert document["format"] == FORMAT_NAME and document["version"] == FORMAT_VERSION
    assert [p.name for p in tmp_path.iterdir()] == ["estimator.json"]  # no temp file left


def test_caller_config_wins_and_accumulators_optional(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    save_snapshot(_trained(), path)
    document = json.loads(path.read_text())
    del document["accumulators"]
    path.write_text(json.dumps(document))
    config = dataclasses.replace(CONFIG, refit_interval=50)
    back = load_snapshot(path, config, "cpu")
    assert back.config.refit_interval == 50 and back.stats.total().item() == 0


def test_overwrite_replaces_the_old_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("old")
    save_snapshot(_trained(), path)
    load_snapshot(path, CONFIG)
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


@pytest.mark.parametrize("step", ["fsync", "replace"])
def test_failed_write_keeps_the_old_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    """A write that fails after the temporary file exists (fsync) or at the rename leaves the
    old snapshot byte for byte and no temporary file."""
    path = tmp_path / "s.json"
    save_snapshot(AcceptanceEstimator(CONFIG), path)
    old = path.read_bytes()

    def fail(*args: object) -> None:
        raise OSError(f"injected {step} failure")

    monkeypatch.setattr(snapshot.os, step, fail)
    with pytest.raises(OSError, match="injected"):
        save_snapshot(_trained(), path)
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]
    assert load_snapshot(path, CONFIG).num_refits == 0


def _write(path: Path, **changes: object) -> Path:
    save_snapshot(_trained(), path)
    document = json.loads(path.read_text())
    document.update(changes)
    path.write_text(json.dumps(document))
    return path


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"format": "something-else"}, "format 'something-else'"),
        ({"version": 2}, "version 2"),
        ({"slope": "fast"}, "malformed"),
        ({"intercepts": [0.1, 0.2]}, "malformed"),
        ({"intercepts": [0.1, None, 0.2]}, "malformed"),
        ({"num_steps": 1.5}, "integers"),
        ({"config": []}, "malformed"),
        ({"accumulators": {"A": [0, 0, 0]}}, "malformed"),
        ({"slope": 0.0}, "slope"),
        # finite doubles that overflow float32, or are far outside any fit
        ({"slope": 1e300}, "slope"),
        ({"slope": 1e39}, "slope"),
        ({"slope": 10**400}, "malformed"),  # an integer too large for any float
        ({"slope": 101.0}, "slope"),
        ({"intercepts": [0.1, -1e300, 0.2]}, r"intercepts\[1\]"),
        ({"intercepts": [0.1, 0.2, 101.0]}, r"intercepts\[2\]"),
        ({"accumulators": {**ZERO_STATS, "n": [1.0, -1.0, 0.0]}}, r"accumulators\.n\[1\]"),
        ({"accumulators": {**ZERO_STATS, "C": [-0.5, 0.0, 0.0]}}, r"accumulators\.C\[0\]"),
        ({"accumulators": {**ZERO_STATS, "G0": [0.0, 0.0, 1e400]}}, "accumulators"),
        ({"num_steps": -1}, "num_steps"),
    ],
)
def test_bad_documents(tmp_path: Path, changes: dict, match: str) -> None:
    path = _write(tmp_path / "s.json", **changes)
    with pytest.raises(SnapshotError, match=match):
        load_snapshot(path, CONFIG)


def test_mismatched_config(tmp_path: Path) -> None:
    path = _write(tmp_path / "s.json")
    with pytest.raises(SnapshotError, match="num_positions=3, config has 5"):
        load_snapshot(path, dataclasses.replace(CONFIG, num_positions=5))


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe", b"[1, 2]", b""])
def test_corrupt_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "s.json"
    path.write_bytes(content)
    with pytest.raises(SnapshotError):
        load_snapshot(path, CONFIG)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match="cannot read"):
        load_snapshot(tmp_path / "absent.json", CONFIG)
    assert issubclass(SnapshotError, ValueError)


@pytest.mark.parametrize(
    ("field", "value"),
    [("slope", float("nan")), ("slope", float("inf")), ("intercepts", float("-inf"))],
)
def test_save_refuses_non_finite_state(tmp_path: Path, field: str, value: float) -> None:
    """A bad in-memory state is never persisted: the error names the field, the old file stays."""
    path = tmp_path / "s.json"
    save_snapshot(AcceptanceEstimator(CONFIG), path)
    old = path.read_bytes()
    est = _trained()
    getattr(est, field).fill_(value)
    with pytest.raises(SnapshotError, match=f"refusing to save.*{field}"):
        save_snapshot(est, path)
    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["s.json"]


def test_save_refuses_non_finite_accumulators(tmp_path: Path) -> None:
    est = _trained()
    est.stats.G1[2] = float("nan")
    with pytest.raises(SnapshotError, match=r"accumulators\.G1\[2\]"):
        save_snapshot(est, tmp_path / "s.json")
    assert list(tmp_path.iterdir()) == []


def test_move_aside_renames_next_to_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("bad")
    first = snapshot.move_aside(path)
    path.write_text("bad again")  # same second: a second name, nothing overwritten
    second = snapshot.move_aside(path)
    assert first != second and not path.exists()
    assert first.parent == tmp_path and first.name.startswith("s.json.invalid-")
    assert {first.read_text(), second.read_text()} == {"bad", "bad again"}


def test_pair_identity_is_recorded_only_when_given(tmp_path: Path) -> None:
    path = tmp_path / "estimator.json"
    save_snapshot(_trained(), path, pair_id="abc123")
    assert json.loads(path.read_text())["pair"] == "abc123"
    assert snapshot.snapshot_pair(path) == "abc123"
    load_snapshot(path, CONFIG)  # the field does not disturb loading
    save_snapshot(_trained(), path)
    assert "pair" not in json.loads(path.read_text())
    assert snapshot.snapshot_pair(path) is None
    path.write_text("{broken")
    assert snapshot.snapshot_pair(path) is None
