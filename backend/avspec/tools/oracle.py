"""The oracle bound: fixed K, the oracle and AV replayed on recorded drafts, in modelled time.

Triton-free so that it is unit-tested on constructed inputs; `client/eval_estimator.py` feeds it
the drafts `client/collect_drafts.py` recorded.

Oracle bound (spec section 4 cost model): from steps recorded with every draft verified
(a_r drafts accepted of n_r drafted), with N requests and T tokens the target runs anyway,
- fixed K: tokens sum(a_r + 1), cost draft(N) + verify(T + sum n_r);
- oracle (verifies exactly the drafts that will be accepted): tokens sum(a_r + 1), cost
  draft(N) + verify(T + sum a_r);
- AV: the verifier (fresh estimator, same budget rule) replayed over the recorded features,
  each request verifying v_r drafts: tokens sum(min(v_r, a_r) + 1), cost
  draft(N) + verify(T + sum v_r); its outcome min(v_r, a_r) labels the estimator next step;
- static trim to k: v_r = min(k, n_r) for every request, same tokens and cost rules as AV.
Acceptance is sequential, so verifying a prefix of v_r drafts accepts min(v_r, a_r) of them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avspec.av.cost_table import CostTable
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig


@dataclass
class RecordedSteps:
    """Decode steps recorded with every draft verified; one row per (step, request)."""

    step: np.ndarray  # [rows] int, non-decreasing step index (rows of one step are contiguous)
    seq_id: np.ndarray  # [rows] int
    num_draft: np.ndarray  # [rows] int, drafts proposed (all verified)
    num_accepted: np.ndarray  # [rows] int, 0..num_draft
    features: np.ndarray  # [rows, position] float, logit(q_max) as served
    base_tokens: np.ndarray  # [steps] int, T: tokens the target ran anyway, indexed by step

    def __post_init__(self) -> None:
        rows = self.step.shape[0]
        for name in ("seq_id", "num_draft", "num_accepted"):
            if getattr(self, name).shape != (rows,):
                raise ValueError(
                    f"{name} must have shape ({rows},), got {getattr(self, name).shape}"
                )
        if self.features.ndim != 2 or self.features.shape[0] != rows:
            raise ValueError(
                f"features must have shape ({rows}, position), got {self.features.shape}"
            )
        if rows and (np.diff(self.step) < 0).any():
            raise ValueError("step must be non-decreasing")
        if ((self.num_accepted < 0) | (self.num_accepted > self.num_draft)).any():
            raise ValueError("num_accepted must lie in 0..num_draft")
        if (self.num_draft > self.features.shape[1]).any():
            raise ValueError("num_draft exceeds the feature positions")
        if rows and self.base_tokens.shape[0] <= int(self.step.max()):
            raise ValueError("base_tokens must have an entry for every step index")


def oracle_bound(
    recorded: RecordedSteps,
    draft_cost: CostTable,
    verify_cost: CostTable,
    config: EstimatorConfig | None = None,
    estimator: AcceptanceEstimator | None = None,
) -> dict[str, Any]:
    """Tokens, modelled ms and tokens/ms of fixed K, oracle and AV, and AV's share of the gain.

    The AV replay uses `estimator` (e.g. warm-started; it is updated in place) or a fresh one
    built from `config` (default: the reference starting values, K = positions).
    "fraction" = (AV - fixed) / (oracle - fixed) in tokens/ms; NaN if the oracle gains nothing.
    "trim_to_k"[k]: tokens/ms of verifying the first min(k, n_r) drafts of every request (a
    static trim, same draft cost), k = 0..positions.
    """
    positions = recorded.features.shape[1]
    if estimator is None:
        estimator = AcceptanceEstimator(config or EstimatorConfig(num_positions=positions))
    verifier = AdaptiveVerifier(estimator, draft_cost, verify_cost)
    totals = {arm: [0.0, 0.0] for arm in ("fixed", "oracle", "av")}
    by_k = [[0.0, 0.0] for _ in range(positions + 1)]
    for rows, v in _replay_av(verifier, recorded):
        n, a = recorded.num_draft[rows], recorded.num_accepted[rows]
        base = int(recorded.base_tokens[recorded.step[rows[0]]])
        draft_ms = float(draft_cost(float(len(rows))))
        tokens = float((a + 1).sum())
        for arm, arm_tokens, verified in (
            ("fixed", tokens, n.sum()),
            ("oracle", tokens, a.sum()),
            ("av", float((np.minimum(v, a) + 1).sum()), v.sum()),
        ):
            totals[arm][0] += arm_tokens
            totals[arm][1] += draft_ms + float(verify_cost(float(base + verified)))
        for k in range(positions + 1):
            verified_k = np.minimum(n, k)
            by_k[k][0] += float((np.minimum(verified_k, a) + 1).sum())
            by_k[k][1] += draft_ms + float(verify_cost(float(base + verified_k.sum())))
    return _summary(totals, by_k)


def _replay_av(
    verifier: AdaptiveVerifier, recorded: RecordedSteps
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per recorded step: its rows [rows] and the drafts AV verifies of each [rows] int64.

    The verifier sees each step's features and, as its label, the previous step's outcome
    min(v_r, a_r); sequences absent from a step are released.
    """
    prev_ids: list[int] = []
    prev_outcome = torch.zeros(0, dtype=torch.int32)
    bounds = np.flatnonzero(np.diff(recorded.step)) + 1
    for rows in np.split(np.arange(recorded.step.shape[0]), bounds):
        if rows.size == 0:
            continue
        ids = [int(i) for i in recorded.seq_id[rows]]
        decision = verifier.step(
            seq_ids=torch.as_tensor(ids, dtype=torch.int64),
            features=torch.as_tensor(recorded.features[rows], dtype=torch.float32),
            num_draft_tokens=torch.as_tensor(recorded.num_draft[rows], dtype=torch.int32),
            adaptive=torch.ones(len(rows), dtype=torch.bool),
            prev_num_accepted=prev_outcome,
            release_seq_ids=torch.as_tensor(sorted(set(prev_ids) - set(ids)), dtype=torch.int64),
            base_tokens=int(recorded.base_tokens[recorded.step[rows[0]]]),
        )
        v = decision.num_verify.numpy().astype(np.int64)
        yield rows, v
        got = np.minimum(v, recorded.num_accepted[rows])
        prev_ids, prev_outcome = ids, torch.as_tensor(got, dtype=torch.int32)


def _summary(totals: dict[str, list[float]], by_k: list[list[float]]) -> dict[str, Any]:
    """Tokens/ms per arm and per static trim, and the gains over fixed K (see oracle_bound)."""
    out: dict[str, Any] = {
        arm: {"tokens": t, "ms": ms, "tokens_per_ms": t / ms if ms else math.nan}
        for arm, (t, ms) in totals.items()
    }
    out["trim_to_k"] = [t / ms if ms else math.nan for t, ms in by_k]
    fixed, oracle, av = (out[k]["tokens_per_ms"] for k in ("fixed", "oracle", "av"))
    out["av_gain"] = av / fixed - 1 if fixed else math.nan
    out["oracle_gain"] = oracle / fixed - 1 if fixed else math.nan
    out["fraction"] = (av - fixed) / (oracle - fixed) if oracle > fixed else math.nan
    return out
