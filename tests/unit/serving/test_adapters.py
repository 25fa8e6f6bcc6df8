"""The Triton-free stage adapters behind the model.py files (no server)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
from helpers.server import save_tiny_pair

from avspec.av.snapshot import save_snapshot
from avspec.config import EstimatorConfig
from avspec.serving.adapters import (
    StageAdapter,
    VerifierAdapter,
    load_cost_tables,
    load_estimator,
)
from avspec.serving.repository import STEP_INPUT_DTYPES, StageParams, VerifierParams

K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def first_step(batch: int = 2) -> dict[str, np.ndarray]:
    arrays = {name: np.zeros(batch, dtype=dtype) for name, dtype in STEP_INPUT_DTYPES.items()}
    arrays["seq_ids"] = np.arange(1, batch + 1, dtype=np.int64)
    arrays["input_ids"] = np.full((batch, 3), 65, dtype=np.int32)
    arrays["input_lengths"][:] = 3
    arrays["num_draft_tokens"][:] = K
    arrays["adaptive"][:] = True
    arrays["temperature"][:] = 1.0
    arrays["top_p"][:] = 1.0
    arrays["prev_num_accepted"] = np.zeros(0, dtype=np.int32)
    return arrays


def test_cost_tables_missing_file_falls_back_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        draft, verify = load_cost_tables(tmp_path / "absent.json")
    assert "linear defaults" in caplog.text
    assert float(verify(100)) > float(draft(100))


def test_cost_tables_from_file_and_malformed(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    table = {"sizes": [1, 8], "millis": [1.0, 2.0]}
    path.write_text(json.dumps({"draft_cost": table, "verify_cost": table}))
    draft, _ = load_cost_tables(path)
    assert float(draft(8)) == pytest.approx(2.0)
    path.write_text(json.dumps({"draft_cost": table}))
    with pytest.raises(ValueError, match="unreadable"):
        load_cost_tables(path)


def test_load_estimator_missing_corrupt_and_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EstimatorConfig(num_positions=K)
    snapshot = tmp_path / "snap.json"
    assert float(load_estimator(config, snapshot, "cpu").slope) == 0.5
    snapshot.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert float(load_estimator(config, snapshot, "cpu").slope) == 0.5
    assert "ignoring estimator snapshot" in caplog.text
    estimator = load_estimator(config, None, "cpu")
    estimator.slope.fill_(0.7)
    save_snapshot(estimator, snapshot)
    assert float(load_estimator(config, snapshot, "cpu").slope) == pytest.approx(0.7)


def verifier_step(batch: int = 2) -> dict[str, np.ndarray]:
    return {
        "seq_ids": np.arange(1, batch + 1, dtype=np.int64),
        "draft_features": np.ones((batch, K), dtype=np.float32),
        "num_draft_tokens": np.full(batch, K, dtype=np.int32),
        "adaptive": np.ones(batch, dtype=np.bool_),
        "prev_num_accepted": np.zeros(0, dtype=np.int32),
        "release_seq_ids": np.zeros(0, dtype=np.int64),
        "input_lengths": np.full(batch, 3, dtype=np.int32),
        "reusable": np.zeros(batch, dtype=np.int32),
    }


def test_invalid_snapshot_is_moved_aside_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A finite double that overflows float32 (slope 1e300) must not become an inf slope that
    no refit can save: the file is reported, moved aside, and the next refit writes a valid one."""
    config = EstimatorConfig(num_positions=K, refit_interval=1)
    snapshot = tmp_path / "snap.json"
    save_snapshot(load_estimator(config, None, "cpu"), snapshot)
    document = json.loads(snapshot.read_text())
    snapshot.write_text(json.dumps({**document, "slope": 1e300}))
    with caplog.at_level(logging.WARNING):
        adapter = VerifierAdapter(config, VerifierParams(snapshot_path="snap.json"), tmp_path)
    assert float(adapter.estimator.slope) == config.initial_slope
    assert str(snapshot) in caplog.text and "slope" in caplog.text
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("snap.json.invalid-")]
    assert len(moved) == 1 and json.loads(moved[0].read_text())["slope"] == 1e300
    assert moved[0].name in caplog.text
    assert not snapshot.exists()
    _, stats = adapter(verifier_step())
    assert stats.refitted
    assert float(load_estimator(config, snapshot, "cpu").slope) == pytest.approx(
        float(adapter.estimator.slope)
    )


def test_stage_adapters_run_a_step(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = pair
    params = {"max_draft_tokens": K, "max_sequences": 4, "max_length": 64}
    draft = StageAdapter("draft", StageParams(model_dir=str(draft_dir), **params), tmp_path)
    target = StageAdapter("target", StageParams(model_dir=str(target_dir), **params), tmp_path)
    arrays = first_step()
    drafted = draft(arrays)
    assert drafted["draft_tokens"].shape == (2, K) and drafted["draft_tokens"].dtype == np.int32
    assert drafted["draft_probs"].shape == (2, K, 257)
    assert drafted["draft_features"].dtype == np.float32
    out = target({**arrays, **drafted, "num_verify": np.array([K, 0], dtype=np.int32)})
    assert out["output_ids"].shape == (2, K + 1) and out["num_accepted"][1] == 0
    assert draft.live_sequences == 2 and target.live_sequences == 2


def test_stage_adapter_rejects_unknown_kind(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stage kind"):
        StageAdapter("drafter", StageParams(model_dir=str(pair[1])), tmp_path)


def test_verifier_adapter_counts_refits_and_saves(tmp_path: Path) -> None:
    config = EstimatorConfig(num_positions=K, refit_interval=1)
    params = VerifierParams(cost_tables="", snapshot_path="snap.json")
    adapter = VerifierAdapter(config, params, tmp_path)
    arrays = {
        "seq_ids": np.array([1, 2], dtype=np.int64),
        "draft_features": np.ones((2, K), dtype=np.float32),
        "num_draft_tokens": np.array([K, 2], dtype=np.int32),
        "adaptive": np.array([True, False]),
        "prev_num_accepted": np.zeros(0, dtype=np.int32),
        "release_seq_ids": np.zeros(0, dtype=np.int64),
        "input_lengths": np.array([3, 3], dtype=np.int32),
        "reusable": np.zeros(2, dtype=np.int32),
    }
    outputs, stats = adapter(arrays)
    verify = outputs["num_verify"]
    assert verify.dtype == np.int32 and verify[1] == 2  # AV off: every draft verified
    assert stats.batch_size == 2 and stats.drafted == K + 2
    assert stats.drafted == stats.verified + stats.trimmed and stats.refitted
    outputs, stats = adapter({**arrays, "prev_num_accepted": np.minimum(verify, 1)})
    assert stats.accepted == int(np.minimum(verify, 1).sum())
    assert (tmp_path / "snap.json").is_file()
    slope, intercepts = adapter.coefficients()
    assert len(intercepts) == K and slope > 0
