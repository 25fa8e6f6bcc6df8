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
                       "G0": [...], "G1": [...], "n": [...]},  # optional: the open window
      "pair": "3f2a..."                          # optional: the draft/target pair fitted on
    }

On load the caller's config wins for everything but num_positions, which must match (a
different K means different intercepts). Calibration bins are not saved: the readout restarts.

Value bounds, checked AFTER conversion to the estimator's dtypes (a finite double such as 1e300
becomes inf in float32, and an inf slope can never be saved again, so it must be caught here):

- slope (float32): finite, in [config.min_slope, MAX_SLOPE = 100];
- intercepts (float32): finite, |b_k| <= MAX_ABS_INTERCEPT = 100;
- accumulators (float64): finite; A, C and n are sums of non-negative terms, so >= 0;
- num_steps, num_refits: integers >= 0.

The bounds are sanity bounds, not a model constraint (the starting values are w = 0.5, b = -0.2;
at w = 100 the acceptance curve is already a step): with features clamped to [-40, 40] (the
default `EstimatorConfig.feature_clamp`) the logit w f + b stays within +-4100, far from float32
overflow. `save_snapshot` applies the same checks, so a file it writes always loads (a bad
in-memory state is refused, never persisted). `move_aside` sets an invalid file aside without
deleting it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from avspec.av.estimator import MAX_ABS_INTERCEPT, MAX_SLOPE, NUM_BINS, AcceptanceEstimator
from avspec.config import EstimatorConfig

FORMAT_NAME = "avspec-acceptance-estimator"
FORMAT_VERSION = 1
_STATS = ("A", "B", "C", "G0", "G1", "n")
_NON_NEGATIVE_STATS = ("A", "C", "n")  # sums of s f^2, s = p (1 - p) and label counts


class SnapshotError(ValueError):
    """A snapshot file is unreadable, of another format or version, or does not fit the config.

    `field` names the offending value (e.g. "slope", "accumulators.n[1]") when one is to blame.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def save_snapshot(estimator: AcceptanceEstimator, path: Path, pair_id: str = "") -> None:
    """Write the estimator's coefficients, counters and open accumulators to `path` atomically.

    `pair_id` (non-empty) is recorded as `"pair"`: the draft/target pair the estimator was
    fitted on (`avspec.serving.host.model_pair.pair_identity`), read back by `snapshot_pair`.

    Raises SnapshotError, before touching the file system, if a value is non-finite or out of
    bounds (see the module docstring): the previous file then stays as it was.
    """
    path = Path(path)
    state = estimator.state_dict()
    try:
        check_values(state["slope"], state["intercepts"], state["stats"], estimator.config)
    except SnapshotError as err:
        raise SnapshotError(f"refusing to save {path}: {err}", err.field) from None
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
    if pair_id:
        document["pair"] = pair_id
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
    try:
        check_values(state["slope"], state["intercepts"], state["stats"], config)
    except SnapshotError as err:
        raise SnapshotError(f"{path}: {err}", err.field) from None
    estimator = AcceptanceEstimator(config, device)
    try:
        estimator.load_state_dict(state)
    except ValueError as err:
        raise SnapshotError(f"{path}: {err}") from None
    return estimator


def snapshot_pair(path: Path) -> str | None:
    """The `"pair"` identity recorded in the snapshot at `path`; None when it records none (an
    older snapshot) or cannot be read (`load_snapshot` then reports why)."""
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    pair = document.get("pair") if isinstance(document, dict) else None
    return pair if isinstance(pair, str) and pair else None


def move_aside(path: Path) -> Path:
    """Rename `path` to `<name>.invalid-<UTC time>` in the same directory; return the new path.

    Never overwrites: a name already taken (two in one second) gets a `-2`, `-3`... suffix.
    OSError (e.g. the file vanished or the directory is read-only) propagates.
    """
    path = Path(path)
    stem = f"{path.name}.invalid-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
    target = path.with_name(stem)
    number = 1
    while target.exists():
        number += 1
        target = path.with_name(f"{stem}-{number}")
    os.rename(path, target)
    return target


def check_values(
    slope: torch.Tensor,
    intercepts: torch.Tensor,
    stats: dict[str, torch.Tensor],
    config: EstimatorConfig,
) -> None:
    """Raise SnapshotError naming the first value outside the bounds of the module docstring.

    Takes the values in the estimator's dtypes (float32 coefficients, float64 accumulators).
    """
    value = float(slope)
    if not config.min_slope <= value <= MAX_SLOPE:  # also False for NaN
        raise SnapshotError(
            f"slope is {value} as {slope.dtype}, must be finite and in "
            f"[{config.min_slope}, {MAX_SLOPE}]",
            "slope",
        )
    _check_elements("intercepts", intercepts, -MAX_ABS_INTERCEPT, MAX_ABS_INTERCEPT)
    for name in _STATS:
        low = 0.0 if name in _NON_NEGATIVE_STATS else -math.inf
        _check_elements(f"accumulators.{name}", stats[name], low, math.inf)


def _check_elements(name: str, values: torch.Tensor, low: float, high: float) -> None:
    """Raise SnapshotError naming the first element of 1-d `values` not finite in [low, high]."""
    ok = torch.isfinite(values) & (values >= low) & (values <= high)
    bad = (~ok).nonzero()
    if len(bad):
        i = int(bad[0, 0])
        field = f"{name}[{i}]"
        raise SnapshotError(
            f"{field} is {float(values[i])} as {values.dtype}, "
            f"must be finite and in [{low}, {high}]",
            field,
        )


def _to_state(path: Path, document: dict[str, Any], config: EstimatorConfig) -> dict[str, Any]:
    """Turn the JSON document into an `AcceptanceEstimator.state_dict`, checking every value."""
    k = config.num_positions
    try:
        saved_k = document["config"]["num_positions"]
        # converted to the estimator's dtypes first: check_values must see what will be used
        slope = _numbers(document["slope"], ()).float()
        intercepts = _numbers(document["intercepts"], (k,)).float() if saved_k == k else None
        num_steps, num_refits = document["num_steps"], document["num_refits"]
        raw_stats = document.get("accumulators")
        if saved_k == k and raw_stats is not None:
            stats = {name: _numbers(raw_stats[name], (k,)) for name in _STATS}
        else:
            stats = {name: torch.zeros(k, dtype=torch.float64) for name in _STATS}
    except (KeyError, TypeError, ValueError, OverflowError) as err:
        raise SnapshotError(f"{path}: malformed snapshot ({err!r})") from None
    if saved_k != k:
        raise SnapshotError(f"{path}: snapshot has num_positions={saved_k}, config has {k}")
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in (num_steps, num_refits)):
        raise SnapshotError(f"{path}: num_steps and num_refits must be integers")
    for name, count in (("num_steps", num_steps), ("num_refits", num_refits)):
        if count < 0:
            raise SnapshotError(f"{path}: {name} is {count}, must be >= 0", name)
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
    """Return `value` (a JSON number or list of numbers) as a float64 tensor of `shape`.

    Non-finite values (Python's json reads NaN, Infinity and 1e400) pass here: `check_values`
    rejects them by field name after the conversion to the estimator's dtypes.
    """
    flat = value if isinstance(value, list) else [value]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in flat):
        raise ValueError(f"expected numbers, got {value!r}")
    tensor = torch.tensor(value, dtype=torch.float64)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"expected shape {shape}, got {tuple(tensor.shape)}")
    return tensor
