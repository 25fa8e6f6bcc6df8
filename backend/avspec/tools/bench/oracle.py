"""The oracle bound: fixed K, the oracle and AV replayed on recorded drafts, in modelled time.

Triton-free so that it is unit-tested on constructed inputs; `client/eval_estimator.py` feeds it
the drafts `client/collect_drafts.py` recorded.

Cost model: avspec.av.step_cost (overhead + the draft's pass over pending tokens + one draft
pass per further position, priced by the rows in it + the target over the tokens it verifies).
From steps recorded with every draft verified (a_r drafts accepted of n_r drafted), with T tokens
the target runs anyway:
- fixed K: drafts n_r, verifies n_r; tokens sum(a_r + 1);
- oracle (drafts and verifies exactly the drafts that will be accepted): drafts a_r, verifies
  a_r; tokens sum(a_r + 1) -- the bound with draft savings;
- AV (verification only): the verifier (fresh estimator, same budget rule) replayed over the
  recorded features, drafting n_r and verifying v_r: tokens sum(min(v_r, a_r) + 1);
- AV + adaptive drafting: the same, with each row drafting d_r <= n_r by the plan the verifier
  handed over at the previous step (avspec.av.drafting), the verifier ranking only those;
- static K = k: drafts and verifies min(k, n_r), the fixed-K arms of a K sweep.
Acceptance is sequential, so verifying a prefix of v_r drafts accepts min(v_r, a_r) of them.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avspec.av.drafting import DraftPlan, drafted_by_plan
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost, rows_per_pass
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.contract import VerifierInputs


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
    cost: StepCost,
    config: EstimatorConfig | None = None,
    estimator: AcceptanceEstimator | None = None,
) -> dict[str, Any]:
    """Tokens, modelled ms and tokens/ms of each arm, and AV's share of the oracle's gain.

    The AV replays use copies of `estimator` (e.g. warm-started) or fresh ones built from
    `config` (default: the reference starting values, K = positions).
    "fraction" / "drafting_fraction" = (arm - fixed) / (oracle - fixed) in tokens/ms for AV
    without / with adaptive drafting; NaN if the oracle gains nothing. "trim_to_k"[k]: tokens/ms
    of drafting and verifying min(k, n_r) drafts of every request, k = 0..positions.
    """
    positions = recorded.features.shape[1]
    totals = {arm: [0.0, 0.0] for arm in ("fixed", "oracle", "av", "av_drafting")}
    by_k = [[0.0, 0.0] for _ in range(positions + 1)]
    for _, arms in arm_steps(recorded, cost, config, estimator):
        for arm, (tokens, ms) in arms.items():
            total = totals[arm] if arm in totals else by_k[int(arm[1:])]
            total[0] += float(tokens.sum())
            total[1] += ms
    return _summary(totals, by_k)


def arm_steps(
    recorded: RecordedSteps,
    cost: StepCost,
    config: EstimatorConfig | None = None,
    estimator: AcceptanceEstimator | None = None,
) -> Iterator[tuple[np.ndarray, dict[str, tuple[np.ndarray, float]]]]:
    """Per recorded step: its rows [rows] and, per arm, (tokens each row gains [rows], modelled
    ms). Arms: "fixed", "oracle", "av", "av_drafting" (module docstring) and "k0".."kK" (static
    K = k; every step, "k0" included, runs the draft's pass over its pending tokens: this
    offline view prices steps one by one, without the deferral of avspec.tools.bench.replay).
    The AV arms replay copies of `estimator` (default: a fresh one from `config`, K =
    positions)."""
    positions = recorded.features.shape[1]
    if estimator is None:
        estimator = AcceptanceEstimator(config or EstimatorConfig(num_positions=positions))
    replays = zip(
        _replay_av(AdaptiveVerifier(copy.deepcopy(estimator), cost, drafting=False), recorded),
        _replay_av(AdaptiveVerifier(copy.deepcopy(estimator), cost), recorded),
        strict=True,
    )
    for (rows, v, _), (_, v_d, d) in replays:
        n, a = recorded.num_draft[rows], recorded.num_accepted[rows]
        base = int(recorded.base_tokens[recorded.step[rows[0]]])
        arms = {
            "fixed": (a + 1, step_ms(cost, base, n, n)),
            "oracle": (a + 1, step_ms(cost, base, a, a)),
            "av": (np.minimum(v, a) + 1, step_ms(cost, base, n, v)),
            "av_drafting": (np.minimum(v_d, a) + 1, step_ms(cost, base, d, v_d)),
        }
        for k in range(positions + 1):
            drafted_k = np.minimum(n, k)
            arms[f"k{k}"] = (
                np.minimum(drafted_k, a) + 1,
                step_ms(cost, base, drafted_k, drafted_k),
            )
        yield rows, arms


def step_ms(
    cost: StepCost,
    base_tokens: int,
    drafted: np.ndarray,
    verified: np.ndarray,
    pending_tokens: int | None = None,
) -> float:
    """Modelled ms of one step: rows drafting `drafted` [rows], the target verifying `verified`
    over `base_tokens`; the draft's pass 0 over `pending_tokens` (None: base_tokens; 0: no pass,
    its inputs deferred)."""
    pending = base_tokens if pending_tokens is None else pending_tokens
    passes = rows_per_pass(pending, drafted.tolist(), int(drafted.max(initial=0)))
    return cost.step_ms(passes, base_tokens + int(verified.sum()), len(drafted))


def _replay_av(
    verifier: AdaptiveVerifier, recorded: RecordedSteps
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per recorded step: its rows [rows], the drafts each drafts [rows] and AV verifies [rows].

    With `verifier.drafting`, each row drafts by the plan of the previous step
    (`drafted_by_plan` on its recorded features), else all it recorded. The verifier sees each
    step's features and, as its label, the previous step's outcome min(v_r, a_r); sequences
    absent from a step are released.
    """
    prev_ids: list[int] = []
    prev_outcome = np.zeros(0, dtype=np.int64)
    plan: DraftPlan | None = None
    bounds = np.flatnonzero(np.diff(recorded.step)) + 1
    for rows in np.split(np.arange(recorded.step.shape[0]), bounds):
        if rows.size == 0:
            continue
        ids = [int(i) for i in recorded.seq_id[rows]]
        base = int(recorded.base_tokens[recorded.step[rows[0]]])
        drafted, v, plan = av_step(
            verifier, recorded, rows, ids, prev_ids, prev_outcome, base, plan
        )
        yield rows, v, drafted
        prev_ids, prev_outcome = ids, np.minimum(v, recorded.num_accepted[rows])


def av_step(
    verifier: AdaptiveVerifier,
    recorded: RecordedSteps,
    rows: np.ndarray | list[int],
    ids: list[int],
    prev_ids: list[int],
    prev_outcome: np.ndarray,
    base_tokens: int,
    plan: DraftPlan | None,
) -> tuple[np.ndarray, np.ndarray, DraftPlan | None]:
    """One replayed step of `verifier` over the recorded `rows` (one per sequence in `ids`):
    each row drafts by `plan` (None: its recorded drafts), the verifier labels the previous
    step with `prev_outcome` (aligned with `prev_ids`; sequences gone since are released) and
    decides. Returns (drafted [rows], num_verify [rows], the plan for the next step)."""
    features = torch.as_tensor(recorded.features[rows], dtype=torch.float32)
    caps = torch.as_tensor(recorded.num_draft[rows], dtype=torch.int32)
    drafted = drafted_by_plan(features, caps, plan, ids) if plan is not None else caps
    decision = verifier.step(
        VerifierInputs(
            seq_ids=torch.as_tensor(ids, dtype=torch.int64),
            features=features,
            num_draft_tokens=caps,
            adaptive=torch.ones(len(ids), dtype=torch.bool),
            prev_num_accepted=torch.as_tensor(prev_outcome, dtype=torch.int32),
            release_seq_ids=torch.as_tensor(sorted(set(prev_ids) - set(ids)), dtype=torch.int64),
            base_tokens=base_tokens,
            num_drafted=drafted.int(),
            adaptive_drafting=torch.full((len(ids),), verifier.drafting),
        )
    )
    return (
        drafted.numpy().astype(np.int64),
        decision.num_verify.numpy().astype(np.int64),
        DraftPlan.from_tensor(decision.draft_plan, features.shape[1]),
    )


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
    drafting = out["av_drafting"]["tokens_per_ms"]
    out["drafting_gain"] = drafting / fixed - 1 if fixed else math.nan
    out["drafting_fraction"] = (drafting - fixed) / (oracle - fixed) if oracle > fixed else math.nan
    return out
