"""The verifier stage: estimator confidences -> survival -> budget -> admitted draft prefixes.

One `AdaptiveVerifier.step` per decode step (spec sections 2-4 and 6), in this order:

1. label the previous step: its outcome `prev_num_accepted` (aligned with the previous batch; -1
   = this row does not feed the refit) and the features / predictions / num_verify recorded then
   go to `estimator.observe`; its measured stage times (`prev_timing_ms`) go to the cost refresh;
   then `estimator.step()` (counts the decode step, refits on schedule);
2. confidences c = estimator.predict(features) at the drafted positions; survival = cumprod(c)
   over each request's drafts;
3. the budget: `avspec.av.drafting.plan_step` over the PREVIOUS step's survival values of the
   sequences present now (matched by seq id on the host; positions the sequence did not draft
   then are extrapolated with its last confidence; a sequence with no previous values scores the
   previous batch's mean row, 1.0 with no previous batch),
   with T = base_tokens + the drafts of requests whose `adaptive` flag is off (those are verified
   in full and take no part in the top-k), and the draft passes priced by the cost tables;
4. admission: the `budget` best survival values among the drafted adaptive candidates
   (avspec.av.survival);
5. record this step for the next one, forget released sequences, and plan the next step's
   drafting from this step's survival rows (`draft_plan`: coefficients, tau, depth).

Why stale scores (losslessness): whether draft x_i is verified may depend only on what was known
before x_i was drawn. Top-k admission with a given budget satisfies this; a budget computed from
this step's survival values does not, because deeper values depend on x_i. Spec section 4's
staircase: one request, costs 1 with no drafts and 2 with one or two, s1 = 0.8, s2 = 0.8 * c2(x1):
the current-step argmax verifies both drafts when s2 > 0.2 and none otherwise, so whether x1 is
verified depends on x1 itself (tests/unit/av/test_lossless.py measures the bias). The previous
step's values are fixed before any of this step's drafts are drawn, so any budget built from them
is safe. The same holds for the plan handed to the next step's draft
(tests/unit/av/test_drafting_exact.py proves both by exact enumeration).

Host-side work: seq ids are read on the host (a device `seq_ids` is copied, which syncs) to
match rows; `check_values=True` also validates the inputs (shapes, devices, values) on the host,
for callers outside the step (the stages leave it off: the step's inputs are checked once, where
they enter the draft stage, `avspec.contract.read_step_inputs`); the cost refresh reads the
previous step's drafted counts (long finished by then). Everything else stays on the features'
device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from avspec.av.budget import plan_step
from avspec.av.drafting import probe_stride, row_depths
from avspec.av.estimator import AcceptanceEstimator, accepted_counts
from avspec.av.step_cost import StepCost, rows_per_pass
from avspec.av.survival import admit, survival
from avspec.checks import check_finite, check_same_device, check_shape
from avspec.contract import VerifierInputs

# Every this many steps a plan of depth 0 drafts one position: without fresh scores a row the
# plan stopped keeps its stale ones, and a stop decided once would hold for the rest of the
# request (step logs: 30+ steps without a draft at concurrency 1, next to none after at 16).
PROBE_INTERVAL = 8
# A probe takes about this many requests of a batch (every one of a batch up to this size), by
# seq id (avspec.av.drafting.probed): the same ones each time, so only their drafts catch up.
PROBE_ROWS = 8
# A request's stale row is an average of its fresh rows, this weight on the previous average.
# One step's features say little about the next (position-0 logit(q_max) of consecutive steps
# correlates 0.16-0.22 in served step logs), so a row taken as it came let one low draft stop a
# request until the next probe: at concurrency 1, 0.82-0.92x fixed K = 1 (docs/benchmarks.md).
STALE_WEIGHT = 0.8

if TYPE_CHECKING:
    from avspec.av.cost_refresh import CostRefresh


@dataclass
class VerifyDecision:
    """What the verifier decided for one step. Shapes in the field comments."""

    num_verify: torch.Tensor  # [batch] int32, prefix of drafts to verify, <= num_drafted
    confidences: torch.Tensor  # [batch, position] fp32, predicted acceptance probabilities
    survival: torch.Tensor  # [batch, position] fp32, 0 at padding positions
    budget: torch.Tensor  # [] int64, drafts admitted among adaptive requests (an upper bound)
    drafted: torch.Tensor  # [] int64, sum of num_drafted
    verified: torch.Tensor  # [] int64, sum of num_verify
    trimmed: torch.Tensor  # [] int64, drafted - verified
    draft_plan: torch.Tensor  # [4 + K] float32 on the device, the next step's plan; or empty
    stopped_early: torch.Tensor  # [] int64, sum of num_draft_tokens - num_drafted
    draft_passes: torch.Tensor  # [] int64, draft positions the deepest row drafted
    draft_ms_saved: torch.Tensor  # [] float64, cost-table ms of the passes not run vs the caps


@dataclass
class _Record:
    """The inputs of a step that its outcome, arriving next step, will label."""

    features: torch.Tensor  # [batch, position]
    predictions: torch.Tensor  # [batch, position]
    num_verify: torch.Tensor  # [batch]
    num_drafted: torch.Tensor  # [batch], for the cost refresh
    base_tokens: int  # tokens the target ran besides the admitted drafts


class AdaptiveVerifier:
    """Chooses how many drafts each request verifies, and feeds outcomes back to the estimator.

    cost: the step cost model the budget and the drafting plan use; refresh, when given, updates
    it from measured stage times (avspec.av.cost_refresh). drafting=False emits no plan: every
    row drafts its cap, as before adaptive drafting. probe_interval: every this many steps the
    plan drafts at least one position (0: never) for about `probe_rows` requests, so a stop
    is re-examined on fresh scores.
    """

    def __init__(
        self,
        estimator: AcceptanceEstimator,
        cost: StepCost,
        check_values: bool = False,
        refresh: CostRefresh | None = None,
        drafting: bool = True,
        probe_interval: int = PROBE_INTERVAL,
        probe_rows: int = PROBE_ROWS,
    ) -> None:
        self.estimator = estimator
        self.cost = cost
        self.check_values = check_values
        self.refresh = refresh
        self.drafting = drafting
        self.probe_interval = probe_interval
        if probe_rows < 1:
            raise ValueError(f"probe_rows must be >= 1, got {probe_rows}")
        self.probe_rows = probe_rows
        self._pending: _Record | None = None
        # Last step's survival rows [prev_batch, position] and seq id -> row; released ids leave
        # the map. In steady state the batch repeats in order and the rows are reused as they are.
        self._stale: dict[int, int] = {}
        self._stale_values = torch.ones(0, 0)
        self.num_steps = 0
        self.num_observed = 0
        self.num_dropped_records = 0  # outcomes whose length did not match the recorded batch
        self.num_bad_timings = 0  # prev_timing_ms the cost refresh refused
        self._plan_depth: torch.Tensor | None = None  # D of the last plan handed to the draft
        self._probe_stride = 0  # and its probe's stride (0: none)

    def step(self, inputs: VerifierInputs) -> VerifyDecision:
        """Decide num_verify for one step; see the module docstring for the order of work and
        VerifierInputs for the fields. A length of prev_num_accepted other than the previous
        batch drops that record (counted in num_dropped_records). An empty batch labels the
        previous step, returns empty tensors and does not count as a decode step. With
        `check_values`, bad input raises ValueError before any state changes.
        """
        num_drafted = (
            inputs.num_drafted if inputs.num_drafted is not None else inputs.num_draft_tokens
        )
        adaptive_drafting = (
            inputs.adaptive_drafting
            if inputs.adaptive_drafting is not None
            else torch.zeros_like(inputs.adaptive)
        )
        inputs = replace(inputs, num_drafted=num_drafted, adaptive_drafting=adaptive_drafting)
        if self.check_values:
            self._validate(inputs, num_drafted, adaptive_drafting)
        ids = [int(i) for i in inputs.seq_ids.tolist()]
        released = [int(i) for i in inputs.release_seq_ids.tolist()]
        features, num_draft_tokens, adaptive = (
            inputs.features,
            inputs.num_draft_tokens,
            inputs.adaptive,
        )
        base_tokens, prev_num_accepted = inputs.base_tokens, inputs.prev_num_accepted
        self._observe_timing(inputs.prev_timing_ms, prev_num_accepted)
        self._label_previous(prev_num_accepted)
        batch, num_pos = features.shape
        for seq_id in released:
            self._stale.pop(seq_id, None)
        if batch == 0:
            self._pending = None
            return _empty_decision(features)
        self.estimator.step()
        self.num_steps += 1

        positions = torch.arange(num_pos, device=features.device)
        candidates = positions < num_drafted[:, None]  # [batch, position]
        clean = torch.where(candidates, features.float(), torch.zeros_like(features.float()))
        confidences = self.estimator.predict(clean)
        values, candidates = survival(confidences, num_drafted)

        in_topk = candidates & adaptive[:, None]
        stale, known = self._stale_rows(ids, num_pos, features.device)
        # The draft passes of this step ran already: priced as a fixed cost, every drafter at
        # the depth the plan let it reach, none as a price per admitted draft.
        caps = num_draft_tokens.long()
        if self._plan_depth is not None:
            depth = row_depths(self._plan_depth.to(caps.device), ids, self._probe_stride)
            reach = torch.minimum(caps, depth)
            caps = torch.where(adaptive.bool() & adaptive_drafting.bool(), reach, caps)
        plan = plan_step(
            stale, caps, adaptive, torch.zeros_like(adaptive_drafting), base_tokens, self.cost
        )
        admitted = admit(values, in_topk, plan.budget)
        num_verify = torch.where(adaptive, admitted, num_drafted.int()).int()

        self._pending = _Record(clean, confidences, num_verify, num_drafted, base_tokens)
        # a request's fresh row joins its running average (STALE_WEIGHT); a row that drafted
        # nothing (depth 0, or its cap 0) keeps the values it had: with no fresh ones it would
        # score 1.0 and pull the next plan back into drafting
        rows = _extrapolated_survival(confidences, candidates)
        rows = torch.where(known[:, None], torch.lerp(rows, stale, STALE_WEIGHT), rows)
        rows = torch.where((num_drafted == 0)[:, None], stale, rows)
        self._stale = {seq_id: index for index, seq_id in enumerate(ids)}
        self._stale_values = rows
        drafted = num_drafted.long().sum()
        verified = num_verify.long().sum()
        return VerifyDecision(
            num_verify, confidences, values, plan.budget, drafted, verified, drafted - verified,
            draft_plan=self._next_plan(rows, num_draft_tokens, adaptive, adaptive_drafting,
                                       base_tokens),
            stopped_early=num_draft_tokens.long().sum() - drafted,
            draft_passes=num_drafted.long().max(),
            draft_ms_saved=self._draft_ms_saved(num_draft_tokens, num_drafted, num_pos),
        )  # fmt: skip

    def _next_plan(
        self,
        rows: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        adaptive: torch.Tensor,
        adaptive_drafting: torch.Tensor,
        base_tokens: int,
    ) -> torch.Tensor:
        """The plan of the next step from this step's survival rows (this batch as its proxy).

        [4 + K] float32 on the estimator's device: threshold, depth, slope, probe stride,
        intercepts (the layout of DraftPlan.to_tensor), built without a host sync; empty when
        drafting is off. A probe (every `probe_interval` steps) gives about `probe_rows`
        requests at least one position: fresh scores for rows the plan had stopped.
        """
        if not self.drafting:
            self._plan_depth = None
            return torch.zeros(0, device=rows.device)
        plan = plan_step(
            rows, num_draft_tokens, adaptive, adaptive_drafting, base_tokens, self.cost,
            for_next_step=True,
        )  # fmt: skip
        stride = 0
        if self.probe_interval and self.num_steps % self.probe_interval == 0:
            stride = probe_stride(rows.shape[0], self.probe_rows)
        self._plan_depth, self._probe_stride = plan.depth, stride
        head = torch.stack([plan.threshold.float(), plan.depth.float(), self.estimator.slope])
        stride_t = torch.full((1,), float(stride), device=rows.device)
        return torch.cat([head, stride_t, self.estimator.intercepts[: rows.shape[1]].float()])

    def _draft_ms_saved(
        self, caps: torch.Tensor, drafted: torch.Tensor, num_pos: int
    ) -> torch.Tensor:
        """Cost-table ms of the draft passes p >= 1 the caps would have run and were not run."""
        passes = torch.arange(1, num_pos, device=caps.device)  # [K - 1]
        full = (caps.long()[None, :] > passes[:, None]).sum(1)
        ran = (drafted.long()[None, :] > passes[:, None]).sum(1)
        return (self.cost.pass_ms(full) - self.cost.pass_ms(ran)).sum()

    def _observe_timing(
        self, prev_timing_ms: torch.Tensor | None, prev_num_accepted: torch.Tensor
    ) -> None:
        """Hand the previous step's stage times, with its sizes, to the cost refresh."""
        pending = self._pending
        if (
            self.refresh is None
            or prev_timing_ms is None
            or prev_timing_ms.numel() == 0
            or pending is None
            or pending.num_verify.shape[0] != prev_num_accepted.shape[0]
        ):
            return
        timing = [float(t) for t in prev_timing_ms.detach().cpu().tolist()]
        drafted = pending.num_drafted.detach().cpu().tolist()
        k = len(timing) - 2
        rows = rows_per_pass(pending.base_tokens, drafted, k)
        tokens = pending.base_tokens + int(pending.num_verify.detach().cpu().long().sum())
        try:
            self.refresh.observe(
                rows, timing[:k], tokens, timing[k], timing[k + 1], verify_rows=len(drafted)
            )
        except ValueError:
            self.num_bad_timings += 1

    def _label_previous(self, prev_num_accepted: torch.Tensor) -> None:
        pending = self._pending
        if prev_num_accepted.numel() == 0:
            self._pending = None
            return
        if pending is None or pending.num_verify.shape[0] != prev_num_accepted.shape[0]:
            self._pending = None
            self.num_dropped_records += 1
            return
        self.estimator.observe(
            pending.features,
            pending.predictions,
            pending.num_verify,
            prev_num_accepted,
            check_values=self.check_values,
        )
        self._pending = None
        self.num_observed += 1

    def _stale_rows(
        self, ids: list[int], num_pos: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Previous survival rows [batch, position] for `ids`, and which ids had one [batch]
        bool. A sequence without one scores the previous batch's mean row (1.0 when there was
        none): a new request is expected to draft like the requests it joins. Scored 1.0, the
        two or three requests that join a 64-row batch every step looked like sure drafts and
        pulled each next plan into drawing x_0 for every row, where no draft paid."""
        values = _fit_columns(self._stale_values, num_pos)
        if len(ids) == values.shape[0] and list(self._stale) == ids:
            # the same batch in the same order as last step
            return values, torch.ones(len(ids), dtype=torch.bool, device=device)
        prior = values.mean(0) if values.shape[0] else torch.ones(num_pos, device=device)
        index = [self._stale.get(i) for i in ids]
        rows = torch.stack([prior if r is None else values[r] for r in index])
        known = torch.tensor([r is not None for r in index], dtype=torch.bool, device=device)
        return rows, known

    def _validate(
        self, inputs: VerifierInputs, num_drafted: torch.Tensor, adaptive_drafting: torch.Tensor
    ) -> None:
        """ValueError naming the first problem of `inputs` (`num_drafted` and
        `adaptive_drafting`: the inputs' own, filled in)."""
        seq_ids, features, num_draft_tokens = (
            inputs.seq_ids,
            inputs.features,
            inputs.num_draft_tokens,
        )
        adaptive, prev_num_accepted = inputs.adaptive, inputs.prev_num_accepted
        release_seq_ids, base_tokens = inputs.release_seq_ids, inputs.base_tokens
        check_shape("features", features, (None, None))
        batch, num_pos = features.shape
        check_shape("seq_ids", seq_ids, (batch,))
        check_shape("num_draft_tokens", num_draft_tokens, (batch,))
        check_shape("adaptive", adaptive, (batch,))
        check_shape("num_drafted", num_drafted, (batch,))
        check_shape("adaptive_drafting", adaptive_drafting, (batch,))
        check_shape("prev_num_accepted", prev_num_accepted, (None,))
        check_shape("release_seq_ids", release_seq_ids, (None,))
        check_same_device(
            features=features, num_draft_tokens=num_draft_tokens, adaptive=adaptive,
            num_drafted=num_drafted, adaptive_drafting=adaptive_drafting,
        )  # fmt: skip
        if prev_num_accepted.numel():
            check_same_device(features=features, prev_num_accepted=prev_num_accepted)
        if batch and num_pos == 0:
            raise ValueError("features has K = 0 draft positions; K must be >= 1")
        limit = self.estimator.config.num_positions
        if num_pos > limit:
            raise ValueError(f"features has {num_pos} positions, estimator has {limit}")
        if features.device != self.estimator.device:
            raise ValueError(f"features on {features.device}, estimator on {self.estimator.device}")
        if not features.is_floating_point():
            raise ValueError(f"features must be floating point, got {features.dtype}")
        for name, t in (("adaptive", adaptive), ("adaptive_drafting", adaptive_drafting)):
            if t.dtype != torch.bool:
                raise ValueError(f"{name} must be a bool tensor, got {t.dtype}")
        for name, t in (
            ("seq_ids", seq_ids), ("num_draft_tokens", num_draft_tokens),
            ("num_drafted", num_drafted), ("prev_num_accepted", prev_num_accepted),
            ("release_seq_ids", release_seq_ids),
        ):  # fmt: skip
            if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
                raise ValueError(f"{name} must be an integer tensor, got {t.dtype}")
        if isinstance(base_tokens, bool) or not isinstance(base_tokens, int) or base_tokens < 0:
            raise ValueError(f"base_tokens must be an int >= 0, got {base_tokens!r}")
        ids = [int(i) for i in seq_ids.cpu().tolist()]
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        self._check_values(features, num_draft_tokens, num_drafted, prev_num_accepted)

    def _check_values(
        self,
        features: torch.Tensor,
        num_draft_tokens: torch.Tensor,
        num_drafted: torch.Tensor,
        prev_num_accepted: torch.Tensor,
    ) -> None:
        num_pos = features.shape[1]
        if bool(((num_draft_tokens < 0) | (num_draft_tokens > num_pos)).any()):
            raise ValueError(f"num_draft_tokens must lie in 0..{num_pos}")
        if bool(((num_drafted < 0) | (num_drafted > num_draft_tokens)).any()):
            raise ValueError("num_drafted must lie in 0..num_draft_tokens")
        candidates = torch.arange(num_pos, device=features.device) < num_drafted[:, None]
        check_finite("features at draft positions", torch.where(candidates, features, 0.0))
        if bool((features[candidates] == float("-inf")).any()):
            raise ValueError("features at draft positions contains -inf")
        pending = self._pending
        if pending is not None and pending.num_verify.shape[0] == prev_num_accepted.shape[0]:
            accepted, _ = accepted_counts(prev_num_accepted)
            if bool((accepted > pending.num_verify).any()):
                raise ValueError(
                    "prev_num_accepted must lie in 0..the previous step's num_verify, "
                    "or be -1 - that (refit_excluded: not for the refit)"
                )


def _fit_columns(values: torch.Tensor, num_pos: int) -> torch.Tensor:
    """Rows [n, old_position] cut or extended (repeating the last column, or 1.0) to num_pos."""
    if values.shape[1] >= num_pos:
        return values[:, :num_pos]
    last = values[:, -1:] if values.shape[1] else values.new_ones(values.shape[0], 1)
    return torch.cat([values, last.expand(-1, num_pos - values.shape[1])], dim=1)


def _extrapolated_survival(confidences: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
    """Survival rows [batch, position] for the next step's stale scores.

    Past a row's last drafted position the confidence of that position is repeated (a geometric
    tail), so a row that drafted less than its cap still ranks its deeper positions sensibly
    next step; a row that drafted nothing scores 1.0 everywhere, like a new sequence.
    """
    count = candidates.sum(-1, keepdim=True)  # [batch, 1]
    last = confidences.gather(-1, (count - 1).clamp_min(0))  # [batch, 1]
    filled = torch.where(candidates, confidences, torch.where(count > 0, last, 1.0))
    return torch.cumprod(filled, -1)


def _empty_decision(features: torch.Tensor) -> VerifyDecision:
    device = features.device
    empty = torch.zeros(features.shape, device=device)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return VerifyDecision(
        torch.zeros(0, dtype=torch.int32, device=device), empty, empty.clone(), zero, zero,
        zero.clone(), zero.clone(), torch.zeros(0, device=device), zero.clone(), zero.clone(),
        torch.zeros((), dtype=torch.float64, device=device),
    )  # fmt: skip
