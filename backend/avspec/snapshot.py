"""Versioned save / restore of the acceptance estimator (warm start across restarts).

File format: one JSON object, UTF-8, written atomically (temporary file + os.replace):

    {
      "format": "avspec-acceptance-estimator",   # fixed name
      "version": 1,                              # bumped on any incompatible change
      "config": {...},                           # EstimatorConfig fields as saved
      "slope": 0.53,                             # w
      "intercepts": [0.41, 0.12, ...],           # b_k, num_positions entries
      "num_steps": 1200, "num_refits": 12,       # counters
      "accumulators": {"A": [...], "B": [...], "C": [...],
                       "G0": [...], "G1": [...], "n": [...]}   # optional: the open window
    }

On load the caller's config wins for everything but num_positions, which must match (a
different K means different intercepts). Calibration bins are not saved: the readout restarts.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from avspec.config import EstimatorConfig
from avspec.estimator import NUM_BINS, AcceptanceEstimator

FORMAT_NAME = "avspec-acceptance-estimator"
FORMAT_VERSION = 1
_STATS = ("A", "B", "C", "G0", "G1", "n")


class SnapshotError(ValueError):
    """A snapshot file is unreadable, of another format or version, or does not fit the config."""


def save_snapshot(estimator: AcceptanceEstimator, path: Path) -> None:
    """Write the estimator's coefficients, counters and open accumulators to `path` atomically."""
    state = estimator.state_dict()
    document = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "config": state["config"],
        "slope": float(state["slope"]),
        "intercepts": state["intercepts"].tolist(),
        "num_steps": state["num_steps"],
        "num_refits": state["num_refits"],
        "accumulators": {k: v.tolist() for k, v in state["stats"].items()},
    }
    path = Path(path)
    text = json.dumps(document, indent=1, allow_nan=False)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def load_snapshot(
    path: Path, config: EstimatorConfig, device: torch.device | str = "cpu"
) -> AcceptanceEstimator:
    """Build an estimator with `config` on `device` from the snapshot at `path`."""
    path = Path(path)
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise SnapshotError(f"cannot read estimator snapshot {path}: {err}") from None
    if not isinstance(document, dict):
        raise SnapshotError(f"{path}: snapshot must be a JSON object")
    if document.get("format") != FORMAT_NAME:
        raise SnapshotError(f"{path}: format {document.get('format')!r}, expected {FORMAT_NAME!r}")
    if document.get("version") != FORMAT_VERSION:
        raise SnapshotError(
            f"{path}: version {document.get('version')!r}, this code reads {FORMAT_VERSION}"
        )
    state = _to_state(path, document, config)
    estimator = AcceptanceEstimator(config, device)
    try:
        estimator.load_state_dict(state)
    except ValueError as err:
        raise SnapshotError(f"{path}: {err}") from None
    return estimator


def _to_state(path: Path, document: dict[str, Any], config: EstimatorConfig) -> dict[str, Any]:
    """Turn the JSON document into an `AcceptanceEstimator.state_dict`, checking every value."""
    k = config.num_positions
    try:
        saved_k = document["config"]["num_positions"]
        slope = _numbers(document["slope"], ())
        intercepts = _numbers(document["intercepts"], (k,)) if saved_k == k else None
        num_steps, num_refits = document["num_steps"], document["num_refits"]
        raw_stats = document.get("accumulators")
        if saved_k == k and raw_stats is not None:
            stats = {name: _numbers(raw_stats[name], (k,)) for name in _STATS}
        else:
            stats = {name: torch.zeros(k, dtype=torch.float64) for name in _STATS}
    except (KeyError, TypeError, ValueError) as err:
        raise SnapshotError(f"{path}: malformed snapshot ({err!r})") from None
    if saved_k != k:
        raise SnapshotError(f"{path}: snapshot has num_positions={saved_k}, config has {k}")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in (num_steps, num_refits)):
        raise SnapshotError(f"{path}: num_steps and num_refits must be integers")
    return {
        "config": dataclasses.asdict(config),
        "slope": slope,
        "intercepts": intercepts,
        "stats": stats,
        "bins": torch.zeros(3, NUM_BINS, dtype=torch.float64),
        "last_bins": torch.zeros(3, NUM_BINS, dtype=torch.float64),
        "num_steps": num_steps,
        "num_refits": num_refits,
    }


def _numbers(value: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """Return `value` (a JSON number or list of numbers) as a float64 tensor of `shape`."""
    flat = value if isinstance(value, list) else [value]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in flat):
        raise ValueError(f"expected numbers, got {value!r}")
    if not all(math.isfinite(x) for x in flat):
        raise ValueError(f"non-finite number in {value!r}")
    tensor = torch.tensor(value, dtype=torch.float64)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"expected shape {shape}, got {tuple(tensor.shape)}")
    return tensor
