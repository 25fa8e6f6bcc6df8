"""The budget of a step, and the drafting plan that comes with it, from stale survival values.

Spec section 4, extended with the draft side (section 6): rank the candidate draft positions by
survival values known before the step (the previous step's), then

    expected_tokens[b] = N + sum of the b best scores               (expected_tokens[0] = N)
    cost[b]            = the step's ms when the b best are drafted and verified (StepCost)
    budget             = argmax_b expected_tokens[b] / cost[b]       (ties -> smallest b)

For losslessness the scores must be known before this step's drafts were sampled: the verifier
passes the PREVIOUS step's survival values (see avspec.av.verifier). The same ranking gives the
next step's drafting plan (depth D and threshold tau, avspec.av.drafting).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avspec.av.step_cost import StepCost
from avspec.checks import check_same_device, check_shape


@dataclass
class StepPlan:
    """`plan_step`'s result; 0-dim tensors on the scores' device (no host sync)."""

    budget: torch.Tensor  # int64: drafts admitted among adaptive candidates
    depth: torch.Tensor  # int64: D, draft positions for rows drafting adaptively (0: none)
    threshold: torch.Tensor  # float64: tau in [0, 1]
    expected_tokens: torch.Tensor  # float64: tokens expected at the budget
    expected_ms: torch.Tensor  # float64: step ms the cost model predicts at the budget
    base_ms: torch.Tensor  # float64: the same with no adaptive draft admitted (budget 0)


def plan_step(
    stale: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    adaptive: torch.Tensor,
    adaptive_drafting: torch.Tensor,
    base_tokens: int,
    cost: StepCost,
    price_first_draws: bool = False,
) -> StepPlan:
    """Budget, depth and threshold from stale survival values; see the module doc.

    stale [batch, K]: survival values known before the step (the previous step's, 1.0 where
    unknown), non-increasing along K. num_draft_tokens [batch]: caps. adaptive [batch] bool: the
    request's drafts compete in the top-k (else all its drafts are verified and count in T).
    adaptive_drafting [batch] bool: the request stops by the plan (only meaningful with
    adaptive; otherwise it drafts to its cap and pays those passes whatever the budget).
    base_tokens: tokens the target runs anyway.

        expected[b] = N + sum of the b best stale scores
        ms[b]       = overhead + draft_pass(T) + draft passes of full rows + verify_row_ms * N
                      + the passes the b best need (a draft at position p >= 1 of an adaptive
                        drafter adds one row to pass p) + verify(T + full drafts + b)
        budget      = argmax_b expected[b] / ms[b]   (ties: smallest b)
        depth       = 1 + deepest admitted position of an adaptive drafter (0: none admitted)
        threshold   = (expected / ms at the budget) * (ms[budget] - ms[0]) / budget
                      (budget 0: times the marginal ms of a first draft)

    price_first_draws: for the next step's plan, where depth 0 skips the draft's output layer
    and sampling for every adaptive drafter: a budget admitting any of their drafts also pays
    x_0's draws, priced as one pass of all of them (an overestimate: that pass's forward ran
    over the pending tokens anyway), so a large batch falls back to no drafts when x_0 alone
    does not pay for itself. Off for the step's own budget, whose x_0 was drawn already.

    The threshold is the exchange rate of the budget: a draft is worth drafting while its
    survival pays for what an admitted draft costs on average (its row in a draft pass, its
    token in verification, its share of the passes opened and of the verify table's steps).
    Measured on replays of recorded drafts (bench/drafts.npz, client/eval_estimator.py), this
    beat the slope at the budget (which a staircase table turns into the price of the next
    step), the slope just below it, and the lowest admitted score.
    """
    check_shape("stale", stale, (None, None))
    batch, num_pos = stale.shape
    for name, t in (
        ("num_draft_tokens", num_draft_tokens), ("adaptive", adaptive),
        ("adaptive_drafting", adaptive_drafting),
    ):  # fmt: skip
        check_shape(name, t, (batch,))
    check_same_device(stale=stale, num_draft_tokens=num_draft_tokens, adaptive=adaptive)
    if isinstance(base_tokens, bool) or int(base_tokens) < 0:
        raise ValueError(f"base_tokens must be an int >= 0, got {base_tokens!r}")
    if batch and num_pos == 0:
        raise ValueError("stale has K = 0 draft positions; K must be >= 1")
    device = stale.device
    caps = num_draft_tokens.long()
    adaptive = adaptive.bool()
    drafter = adaptive & adaptive_drafting.to(device).bool()  # [batch]
    positions = torch.arange(num_pos, device=device)
    within = positions < caps[:, None]  # [batch, K]
    candidates = within & adaptive[:, None]
    full_drafts = torch.where(adaptive, torch.zeros_like(caps), caps).sum()
    tokens = base_tokens + full_drafts  # verified whatever the budget
    # Rows that draft to their caps fill passes p >= 1 whatever the budget.
    full_rows = (within & ~drafter[:, None]).sum(0)  # [K]
    full_rows[:1] = 0
    # The pending-token pass is priced on the host: a device tensor built from a Python number
    # would be a blocking host-to-device copy on CUDA.
    pending_ms = cost.draft_pass.at(base_tokens) if int(base_tokens) > 0 else 0.0
    rows_ms = cost.verify_row_ms * batch  # every row runs through the target
    fixed_ms = cost.overhead_ms + pending_ms + rows_ms + cost.pass_ms(full_rows).sum()

    # Position-major order with a stable sort: ties go to the earlier position, then the row.
    flat = stale.double().transpose(0, 1).reshape(-1)  # [K * batch], index p * batch + r
    flat_cand = candidates.transpose(0, 1).reshape(-1)
    key = torch.where(flat_cand, flat.clamp(0.0, 1.0), torch.full_like(flat, -1.0))
    order = torch.sort(key, descending=True, stable=True).indices
    scores = key[order].clamp_min(0.0)  # non-candidates last, scoring 0
    pos = order // max(batch, 1)
    row = order % max(batch, 1)
    joins = flat_cand[order] & drafter[row] & (pos >= 1)  # adds a row to draft pass `pos`
    onehot = torch.nn.functional.one_hot(pos, num_pos).long() * joins[:, None].long()  # [n, K]
    before = ((torch.cumsum(onehot, 0) - onehot) * onehot).sum(-1)  # earlier joiners of pass
    rows_then = full_rows[pos] + before
    extra = torch.where(joins, cost.pass_ms(rows_then + 1) - cost.pass_ms(rows_then), 0.0)

    zero = scores.new_zeros(1)
    expected = batch + torch.cat([zero, torch.cumsum(scores, 0)])
    sizes = torch.arange(scores.shape[0] + 1, device=device)
    millis = fixed_ms + torch.cat([zero, torch.cumsum(extra, 0)]) + cost.verify(tokens + sizes)
    drafter_admitted = flat_cand[order] & drafter[row]  # [n]: the b-th best is a drafter's
    if price_first_draws:
        opened = torch.cat([zero.bool(), torch.cumsum(drafter_admitted.long(), 0) > 0])
        first_ms = cost.pass_ms(drafter.sum()).double()
        millis = millis + torch.where(opened, first_ms, 0.0)
    ratio = expected / millis.clamp_min(1e-12)
    budget = torch.where(ratio == ratio.max(), sizes, sizes.shape[0]).min().long()

    admitted = (sizes[1:] <= budget) & drafter_admitted
    deepest = torch.where(admitted, pos + 1, 0)  # 1 + position of each admitted draft
    depth = deepest.max() if deepest.numel() else pos.new_zeros(())
    drafters = drafter.sum()
    # take, not [budget]: indexing by a 0-dim tensor reads it on the host (a CUDA sync, seen on
    # an H200 by client/gpu_check.py)
    rate = ratio.take(budget)
    # ms per admitted draft on average (passes opened and verify-cost steps included), so a
    # staircase table does not make the next step's slope the price of every draft; with
    # nothing admitted, the marginal ms of the first draft.
    first = (
        cost.draft_pass.slope(drafters.clamp_min(1)).double() + cost.verify.slope(tokens).double()
    )
    average = (millis.take(budget) - millis[0]) / budget.clamp_min(1)
    marginal = torch.where(budget > 0, average, first)
    threshold = (rate * marginal).clamp(0.0, 1.0)
    return StepPlan(
        budget, depth.long(), threshold, expected.take(budget), millis.take(budget), millis[0]
    )
