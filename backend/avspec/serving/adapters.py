"""The Triton-free bodies of the draft, verifier and target `model.py` adapters.

Each adapter is built once from its parsed parameters and called with the request's input
tensors as numpy arrays (named as in its config.pbtxt); it returns the output arrays. The
`model.py` files only move tensors in and out of `pb_utils` and push metric values, so
everything here runs in unit tests without a server.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator, accepted_counts
from avspec.av.snapshot import SnapshotError, load_snapshot, move_aside, save_snapshot
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import base_tokens
from avspec.engine.draft_stage import DraftStage
from avspec.engine.target_stage import TargetStage
from avspec.runtime.model_dir import load_model_dir
from avspec.serving.repository import (
    StageParams,
    VerifierParams,
    resolve_path,
    step_inputs_from_numpy,
    to_numpy,
)

logger = logging.getLogger(__name__)

# Linear fallbacks when no measured cost tables exist: target 10x the draft.
FALLBACK_MAX_SEQUENCES = 128
FALLBACK_MAX_TOKENS = 128 * 512


def load_cost_tables(path: Path | None) -> tuple[CostTable, CostTable]:
    """Return (draft_cost, verify_cost) from the profiler's JSON, or linear defaults.

    A missing path or file falls back to `CostTable.linear` defaults with a logged warning; a
    file that exists but is malformed raises ValueError (a broken measurement must not pass).
    """
    if path is None or not path.is_file():
        logger.warning(
            "cost tables %s not found: using linear defaults (measure them: in-process with "
            "client/profile_costs.py, on a deployment with client/profile_serving_costs.py)",
            path,
        )
        return (
            CostTable.linear(1.0, 0.01, FALLBACK_MAX_SEQUENCES, name="draft_cost"),
            CostTable.linear(10.0, 0.1, FALLBACK_MAX_TOKENS, name="verify_cost"),
        )
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
        return (
            CostTable.from_dict({"name": "draft_cost", **document["draft_cost"]}),
            CostTable.from_dict({"name": "verify_cost", **document["verify_cost"]}),
        )
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise ValueError(f"cost tables {path}: unreadable ({err!r})") from None


def load_estimator(
    config: EstimatorConfig, snapshot: Path | None, device: str
) -> AcceptanceEstimator:
    """Warm start: restore the snapshot if there is one, else the starting values.

    A missing file starts fresh silently. An unreadable, mismatched or out-of-bounds one is
    logged (file and field), moved aside to `<name>.invalid-<time>` and the estimator starts
    from the configured values: left in place, a bad file would be read again on every restart
    until a save replaced it, and a state that cannot be saved (inf slope) never would be.
    """
    if snapshot is None or not snapshot.is_file():
        return AcceptanceEstimator(config, device)
    try:
        estimator = load_snapshot(snapshot, config, device)
    except SnapshotError as err:
        try:
            where = f"moved to {move_aside(snapshot)}"
        except OSError as move_err:  # e.g. a second instance moved it first
            where = f"could not move it aside: {move_err}"
        logger.warning(
            "ignoring estimator snapshot%s: %s; %s; starting from the configured "
            "values, the next refit writes a fresh snapshot",
            f" (field {err.field})" if err.field else "",
            err,
            where,
        )
        return AcceptanceEstimator(config, device)
    logger.info("estimator restored from %s", snapshot)
    return estimator


class StageAdapter:
    """The draft or target stage behind a Triton model: KV cache + model + stage object."""

    def __init__(self, kind: str, params: StageParams, root: Path) -> None:
        stages = {"draft": DraftStage, "target": TargetStage}
        if kind not in stages:
            raise ValueError(f"stage kind must be one of {sorted(stages)}, got {kind!r}")
        self.kind = kind
        model, _ = load_model_dir(resolve_path(root, params.model_dir), params.device)
        cache = model.new_cache(params.max_sequences, params.max_length, params.device)
        self.stage = stages[kind](
            model, cache, params.max_draft_tokens, idle_timeout_s=params.idle_timeout_s
        )

    @property
    def live_sequences(self) -> int:
        """Sequences holding a KV cache slot (the av_kv_live_sequences gauge)."""
        return int(self.stage.cache.num_live)

    def __call__(self, arrays: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        inputs = step_inputs_from_numpy(arrays)
        if self.kind == "draft":
            out = self.stage(inputs)
            return {
                "draft_tokens": to_numpy(out.draft_tokens, np.int32),
                "draft_probs": to_numpy(out.draft_probs, np.float32),
                "draft_features": to_numpy(out.draft_features, np.float32),
            }
        out = self.stage(
            inputs,
            torch.from_numpy(np.ascontiguousarray(arrays["draft_tokens"], dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(arrays["draft_probs"], dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(arrays["num_verify"], dtype=np.int32)),
        )
        return {
            "output_ids": to_numpy(out.output_ids, np.int32),
            "num_accepted": to_numpy(out.num_accepted, np.int32),
        }


@dataclass
class VerifierStepStats:
    """What one verifier step reports to the metrics."""

    batch_size: int
    drafted: int
    verified: int
    accepted: int
    trimmed: int
    budget_fraction: float | None  # None when no draft was a candidate
    refitted: bool


class VerifierAdapter:
    """The adaptive verifier behind a Triton model, with warm start and per-step stats."""

    def __init__(self, config: EstimatorConfig, params: VerifierParams, root: Path) -> None:
        self.config = config
        self.snapshot = resolve_path(root, params.snapshot_path) if params.snapshot_path else None
        costs = resolve_path(root, params.cost_tables) if params.cost_tables else None
        draft_cost, verify_cost = load_cost_tables(costs)
        self.estimator = load_estimator(config, self.snapshot, params.device)
        self.verifier = AdaptiveVerifier(self.estimator, draft_cost, verify_cost)
        self.device = self.estimator.device

    def __call__(
        self, arrays: Mapping[str, np.ndarray]
    ) -> tuple[dict[str, np.ndarray], VerifierStepStats]:
        def tensor(name: str, dtype: type) -> torch.Tensor:
            array = np.ascontiguousarray(arrays[name], dtype=dtype)
            return torch.from_numpy(array).to(self.device)

        prev_num_accepted = tensor("prev_num_accepted", np.int32)
        refits = self.estimator.num_refits
        decision = self.verifier.step(
            seq_ids=tensor("seq_ids", np.int64),
            features=tensor("draft_features", np.float32),
            num_draft_tokens=tensor("num_draft_tokens", np.int32),
            adaptive=tensor("adaptive", np.bool_),
            prev_num_accepted=prev_num_accepted,
            release_seq_ids=tensor("release_seq_ids", np.int64),
            base_tokens=base_tokens(
                np.asarray(arrays["input_lengths"], dtype=np.int64),
                np.asarray(arrays["reusable"], dtype=np.int64),
            ),
        )
        refitted = self.estimator.num_refits != refits
        if refitted:
            self.save_snapshot()
        drafted = int(decision.drafted)
        stats = VerifierStepStats(
            batch_size=int(arrays["seq_ids"].shape[0]),
            drafted=drafted,
            verified=int(decision.verified),
            accepted=int(accepted_counts(prev_num_accepted)[0].sum()),
            trimmed=int(decision.trimmed),
            budget_fraction=float(decision.budget) / drafted if drafted else None,
            refitted=refitted,
        )
        return {"num_verify": to_numpy(decision.num_verify, np.int32)}, stats

    def coefficients(self) -> tuple[float, list[float]]:
        """Current (slope, intercepts), host copies for the gauges."""
        return float(self.estimator.slope), [float(b) for b in self.estimator.intercepts]

    def save_snapshot(self) -> None:
        """Write the warm-start snapshot (no-op without snapshot_path); failures are logged."""
        if self.snapshot is None:
            return
        try:
            self.snapshot.parent.mkdir(parents=True, exist_ok=True)
            save_snapshot(self.estimator, self.snapshot)
        except (OSError, ValueError) as err:
            logger.warning("could not save estimator snapshot %s: %s", self.snapshot, err)
