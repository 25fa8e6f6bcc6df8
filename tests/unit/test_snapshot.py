"""Tests for avspec.snapshot: versioned JSON save / restore of the estimator."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from avspec.config import EstimatorConfig
from avspec.estimator import AcceptanceEstimator
from avspec.snapshot import FORMAT_NAME, FORMAT_VERSION, SnapshotError, load_snapshot, save_snapshot

CONFIG = EstimatorConfig(num_positions=3, refit_interval=2)


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


def test_overwrite_is_atomic_replace(tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text("old")
    save_snapshot(_trained(), path)
    load_snapshot(path, CONFIG)


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


def test_failed_save_leaves_no_temp_file(tmp_path: Path) -> None:
    est = _trained()
    est.slope.fill_(float("nan"))  # not representable in strict JSON
    with pytest.raises(ValueError):
        save_snapshot(est, tmp_path / "s.json")
    assert list(tmp_path.iterdir()) == []
