"""Adaptive drafting: the plan of a step, fixed before it, and the per-request stop rule.

The rule (spec section 6; lossless because every decision about draft x_i is fixed before x_i is
drawn):

- **Plan, from stale state.** At the end of step t the verifier ranks step t's survival rows (one
  row per request, the same values the budget of step t + 1 will use) and returns a `DraftPlan`
  for step t + 1: the coefficients as they stood, a threshold tau and a depth D. The scheduler
  carries it into step t + 1's inputs, so the draft never reads state updated in its own step.
- **Per-request stop.** A request drafting adaptively draws x_0 (unless the depth is 0), then
  keeps drafting past position i only while its survival
  s_i = prod_{j <= i} sigmoid(slope * f_j + b_j) stays >= tau. f_j = logit(q_max) at j depends on
  x_{<j} only, so s_i is known before x_i is drawn; nothing looks at the sampled token.
- **Depth.** At most D draft positions for such a request (its `num_draft_tokens` stays the cap);
  the loop also ends when no row is left. Rows that stopped leave the batch (compaction). D = 0
  when the budget admitted no draft of an adaptive drafter: the next step drafts nothing for
  them (the draft runs over their pending tokens only), which is how adaptive drafting falls
  back to no speculation where no draft pays (a large batch on this CPU). A request's stale
  score is a running average of its fresh survival rows (`verifier.STALE_WEIGHT`), so one low
  draft does not stop it; a request that drafted nothing keeps the average it had, so the plan
  is not fooled into drafting again by rows that simply have no fresh values; a new request
  scores the previous batch's mean row, so it brings drafting back only when the batch it joins
  would draft.
- **Probe.** A plan of depth 0 would hold forever on stale rows, so every few steps the verifier
  sends a probe: a stride S > 0 under which a request whose seq id is a multiple of S drafts at
  least x_0 (`probed`). S is 1 (every request) up to `verifier.PROBE_ROWS` requests and grows
  with the batch, so a large batch probes about that many requests, the same ones each time
  (seq ids are fixed): on this CPU a probe of every row of 64 cost the draft's pass over every
  row's deferred inputs (about 200 ms for 8 steps of 64 rows) and the target's verification of
  about 45 drafts, for some 18 accepted tokens. The others keep their averaged rows; a new
  request scores the batch's mean row, and when the probed rows make drafting pay, the plan's
  depth brings every request back.
- **Budget.** The plan's numbers come from `avspec.av.budget.plan_step`, which is also the
  verifier's budget: the argmax of expected tokens per ms over the stale ranking, with the draft
  passes the admitted drafts need priced by the cost tables.
  Admission is then the budget's best fresh survival values among what was drafted; later
  positions of a request never outrank earlier ones (ties: position, then row), so whether x_i is
  admitted depends on s_i, other requests and the stale budget.

Unsafe, and caught by tests/unit/av/test_drafting_exact.py: a batch-level stop from this step's
survivals (e.g. end the loop when the batch's summed survival falls below a cost: it removes
candidates whose rank depended on another draft), a budget from this step's values, a refit or
normalisation inside the step, a decision on q(x_i) of the token itself. Comparing a row with
another row at the same position is safe (that test proves it): both values are known before
either row's x_i is drawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from avspec.checks import check_shape

# Layout of the plan tensor: [threshold, depth, slope, probe stride, intercept_0 .. _{K-1}].
_HEAD = 4


@dataclass(frozen=True)
class DraftPlan:
    """What the draft of the next step may know: coefficients, threshold tau, depth D and the
    probe's stride (0: no probe; see `probed`)."""

    threshold: float
    depth: int
    slope: float
    intercepts: tuple[float, ...]
    probe_stride: int = 0
    # device -> (slope [], intercepts [K]) fp32: one host-to-device copy per plan and device,
    # not one per draft pass (on CUDA each would block the host).
    _on_device: dict = field(default_factory=dict, compare=False, repr=False, hash=False)

    def coefficients(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slope [], intercepts [K]) as fp32 tensors on `device`, copied once."""
        device = torch.device(device)
        if device not in self._on_device:
            values = torch.tensor([self.slope, *self.intercepts], dtype=torch.float32)
            values = values.to(device)
            self._on_device[device] = (values[0], values[1:])
        return self._on_device[device]

    def to_tensor(self) -> torch.Tensor:
        """[4 + K] float32 on the CPU: threshold, depth, slope, probe stride, intercepts."""
        head = [self.threshold, float(self.depth), self.slope, float(self.probe_stride)]
        return torch.tensor(head + list(self.intercepts), dtype=torch.float32)

    def row_depth(self, seq_id: int) -> int:
        """The depth the plan gives request `seq_id`: D, at least 1 when the probe takes it."""
        return max(self.depth, 1) if probed(seq_id, self.probe_stride) else self.depth

    @classmethod
    def from_tensor(cls, plan: torch.Tensor, num_positions: int) -> DraftPlan | None:
        """Read a plan tensor on the host; empty -> None (no plan: draft every row to its cap).

        ValueError naming the problem for a wrong shape or values: non-finite entries, a
        threshold outside [0, 1], a depth that is not an integer in 0..num_positions (0: the
        adaptive drafters draft nothing), a probe stride that is not an integer >= 0, or fewer
        than num_positions intercepts.
        """
        check_shape("draft_plan", plan, (None,))
        if plan.numel() == 0:
            return None
        values = [float(v) for v in plan.detach().cpu().double().tolist()]
        if len(values) < _HEAD + num_positions:
            raise ValueError(
                f"draft_plan has {len(values)} entries, want 4 + {num_positions} "
                "(threshold, depth, slope, probe stride, one intercept per draft position)"
            )
        if any(v != v or v in (float("inf"), float("-inf")) for v in values):
            raise ValueError("draft_plan must be finite")
        threshold, depth, slope, stride = values[:_HEAD]
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"draft_plan threshold {threshold} outside [0, 1]")
        if depth != int(depth) or not 0 <= depth <= num_positions:
            raise ValueError(f"draft_plan depth {depth} is not an integer in 0..{num_positions}")
        if stride != int(stride) or stride < 0:
            raise ValueError(f"draft_plan probe stride {stride} is not an integer >= 0")
        intercepts = tuple(values[_HEAD : _HEAD + num_positions])
        return cls(threshold, int(depth), slope, intercepts, int(stride))


def probed(seq_id: int, stride: int) -> bool:
    """Whether a probe of `stride` takes request `seq_id`: a stride > 0 dividing the id."""
    return stride > 0 and seq_id % stride == 0


def row_depths(depth: torch.Tensor, seq_ids: list[int], stride: int) -> torch.Tensor:
    """[rows] int64 on depth's device: a plan's depth D (`depth`, 0-dim) for each of `seq_ids`,
    at least 1 for the ones a probe of `stride` takes (`DraftPlan.row_depth` as a tensor)."""
    depth = depth.long()
    if not stride:
        return depth.expand(len(seq_ids))
    taken = torch.tensor([probed(i, stride) for i in seq_ids], device=depth.device)
    return torch.where(taken, depth.clamp_min(1), depth)


def probe_stride(batch: int, rows: int) -> int:
    """The stride under which a probe takes about `rows` of a batch of `batch` requests:
    1 (all of them) up to `rows`, then ceil(batch / rows)."""
    return max(1, -(-batch // rows))


def stop_confidence(features: torch.Tensor, position: int, plan: DraftPlan) -> torch.Tensor:
    """Confidence c_i = sigmoid(slope * f_i + b_i) [rows] of position `position` under `plan`.

    features [rows] logit(q_max) at that position (fp32). Computed in fp32 like the estimator's
    `predict`, from the plan's coefficients only.
    """
    slope, intercepts = plan.coefficients(features.device)
    return torch.sigmoid(slope * features.float() + intercepts[position])


def keeps_drafting(survival: torch.Tensor, plan: DraftPlan) -> torch.Tensor:
    """[rows] bool: the rows whose survival after the position just drafted is >= tau."""
    return survival >= plan.threshold


def draft_limits(
    num_draft_tokens: list[int],
    adaptive: list[bool],
    adaptive_drafting: list[bool],
    plan: DraftPlan | None,
    seq_ids: list[int],
) -> tuple[list[int], list[bool]]:
    """Per-row draft limit and whether the row stops by the plan (host lists).

    Without a plan, or for a row that is not adaptive or not drafting adaptively, the limit is
    the row's cap and it never stops early: fixed drafting exactly as without this module.
    Otherwise min(cap, the plan's depth for the row's seq id: DraftPlan.row_depth).
    """
    stops = [plan is not None and a and d for a, d in zip(adaptive, adaptive_drafting, strict=True)]
    limits = [
        min(cap, plan.row_depth(seq_id)) if stop and plan is not None else cap
        for cap, stop, seq_id in zip(num_draft_tokens, stops, seq_ids, strict=True)
    ]
    return limits, stops


def drafted_by_plan(
    features: torch.Tensor, num_draft_tokens: torch.Tensor, plan: DraftPlan, seq_ids: list[int]
) -> torch.Tensor:
    """num_drafted [rows] int32 of rows whose features at every position are known.

    The stop rule of the draft stage applied at once (replays of recorded drafts, where the
    features of positions a row would not have drafted were recorded anyway): a row drafts
    min(cap, its depth) positions (`DraftPlan.row_depth` of its seq id), or fewer: through the
    first position whose survival is < tau. features [rows, K] fp32 logit(q_max);
    num_draft_tokens [rows] caps; seq_ids the rows' requests.
    """
    check_shape("features", features, (None, None))
    rows, k = features.shape
    check_shape("num_draft_tokens", num_draft_tokens, (rows,))
    if len(seq_ids) != rows:
        raise ValueError(f"seq_ids has {len(seq_ids)} ids for {rows} rows")
    depth = torch.tensor(plan.depth, device=features.device)
    limit = torch.minimum(num_draft_tokens.long(), row_depths(depth, seq_ids, plan.probe_stride))
    survival = torch.ones(rows, dtype=torch.float32, device=features.device)
    drafted = torch.zeros(rows, dtype=torch.long, device=features.device)
    going = torch.ones(rows, dtype=torch.bool, device=features.device)
    for position in range(k):
        going = going & (limit > position)
        drafted = drafted + going.long()
        survival = survival * stop_confidence(features[:, position], position, plan)
        going = going & keeps_drafting(survival, plan)
    return drafted.int()
