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
    for_next_step: bool = False,
) -> StepPlan:
    """Budget, depth and threshold from stale survival values; see the module doc.

    stale [batch, K]: survival values known before the step (the previous step's, 1.0 where
    unknown), non-increasing along K. num_draft_tokens [batch]: caps. adaptive [batch] bool: the
    request's drafts compete in the top-k (else all its drafts are verified and count in T).
    adaptive_drafting [batch] bool: the request stops by the plan (only meaningful with
    adaptive; otherwise it drafts to its cap and pays those passes whatever the budget).
    base_tokens: tokens the target runs anyway.

        expected[b] = N + sum of the b best stale scores
        ms[b]       = overhead + pending_pass(T) + draft passes of full rows + verify_row_ms * N
                      + the passes the b best need (a draft at position p >= 1 of an adaptive
                        drafter adds one row to pass p) + verify(T + full drafts + b)
                      + probs_row_ms * N * width (width: the deepest position a full row
                        drafts to or one of the b best sits at, plus one; at least 1)
        budget      = argmax_b expected[b] / ms[b]   (ties: smallest b)
        depth       = 1 + deepest admitted position of an adaptive drafter (0: none admitted)
        threshold   = (expected / ms at the budget) * (ms[budget] - ms[0]) / budget
                      (budget 0: times the marginal ms of a first draft)

    for_next_step: for the next step's plan, two more things are priced.
    - Opening: when no other row drafts, a budget admitting no drafter's draft saves the pass
      over the pending tokens (a draft whose rows all draw nothing defers it,
      avspec.engine.draft_stage), priced by the pending-pass table at base_tokens (output layer
      and draws included, as the table measured them). So a batch falls back to no draft pass
      at all when its x_0s do not pay for that pass. Replayed (client/replay_steps.py), this
      beat adding one pass of all the drafters as the price of their draws, which doubled the
      price of opening on a memory-bound GPU (ad8 / best arm 0.90-0.97 against 0.96-1.01).
    - Depth: the argmax runs over every depth limit D = 0..K as well, the drafters' candidates
      restricted to positions < D (ties: smallest D). A draft pass costs about the same for 1
      row as for 64 on a memory-bound GPU, so a prefix of the score order (whose best scores are
      often deep positions of confident rows, each opening a pass) can price every x_0 of a
      large batch out, where x_0 alone, with no deeper pass, pays.
    Off for the step's own budget, whose draws and passes were made already.

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
    pending_ms = cost.pending_ms(int(base_tokens))
    rows_ms = cost.verify_row_ms * batch  # every row runs through the target
    # The draft probabilities' hop: every row, as deep as the deepest row may draft.
    full_width = torch.where(within & ~drafter[:, None], positions + 1, 1)  # [batch, K]
    base_width = full_width.max() if batch else positions.new_ones(())
    hop_ms = cost.probs_row_ms * batch
    fixed_ms = (
        cost.overhead_ms + pending_ms + rows_ms + cost.pass_ms(full_rows).sum()
        + hop_ms * base_width.double()
    )  # fmt: skip

    # One curve per depth limit D (only D = K without for_next_step): the drafters'
    # candidates at positions < D. Position-major order with a stable sort: ties go to the
    # earlier position, then the row.
    limits = torch.arange(num_pos + 1, device=device) if for_next_step else positions[-1:] + 1
    kept = ~drafter[None, :, None] | (positions[None, None, :] < limits[:, None, None])
    flat_cand = (candidates[None] & kept).transpose(1, 2).reshape(limits.shape[0], -1)  # [D, n]
    flat = stale.double().transpose(0, 1).reshape(-1)  # [K * batch], index p * batch + r
    key = torch.where(flat_cand, flat.clamp(0.0, 1.0), torch.full_like(flat, -1.0))
    order = torch.sort(key, dim=1, descending=True, stable=True).indices
    scores = key.gather(1, order).clamp_min(0.0)  # non-candidates last, scoring 0
    cand = flat_cand.gather(1, order)
    pos = order // max(batch, 1)
    row = order % max(batch, 1)
    joins = cand & drafter[row] & (pos >= 1)  # adds a row to draft pass `pos`
    onehot = torch.nn.functional.one_hot(pos, num_pos).long() * joins[..., None].long()
    before = ((torch.cumsum(onehot, 1) - onehot) * onehot).sum(-1)  # earlier joiners of pass
    rows_then = full_rows[pos] + before
    extra = torch.where(joins, cost.pass_ms(rows_then + 1) - cost.pass_ms(rows_then), 0.0)
    drafter_admitted = cand & drafter[row]  # [D, n]: the b-th best is a drafter's
    if hop_ms > 0:  # a deeper draft widens the probabilities of every row
        reach = torch.where(drafter_admitted, pos + 1, 0).clamp_min(base_width)
        wide = torch.cummax(reach, dim=1).values  # [D, n]: the width once the b-th is admitted
        widened = wide - torch.cat([base_width.expand(wide.shape[0], 1), wide[:, :-1]], 1)
        extra = extra + hop_ms * widened.double()

    zero = scores.new_zeros(limits.shape[0], 1)
    expected = batch + torch.cat([zero, torch.cumsum(scores, 1)], 1)  # [D, n + 1]
    sizes = torch.arange(scores.shape[1] + 1, device=device)
    verify = cost.verify(tokens + sizes).double()
    millis = fixed_ms + torch.cat([zero, torch.cumsum(extra, 1)], 1) + verify
    if for_next_step:
        opened = torch.cat([zero.bool(), torch.cumsum(drafter_admitted.long(), 1) > 0], 1)
        others_draft = ((caps > 0) & ~drafter).any()  # they run the pending pass anyway
        millis = millis - torch.where(others_draft | opened, 0.0, pending_ms)
    ratio = expected / millis.clamp_min(1e-12)
    flat_ratio = ratio.reshape(-1)  # index d * (n + 1) + b: ties -> smallest D, then b
    where = torch.arange(flat_ratio.shape[0], device=device)
    best = torch.where(flat_ratio == flat_ratio.max(), where, flat_ratio.shape[0]).min()
    width = sizes.shape[0]
    # take / index_select, not [...]: indexing by a 0-dim tensor reads it on the host (a CUDA
    # sync, seen on an H200 by client/gpu_check.py)
    chosen = (best // width).reshape(1)
    budget = best % width
    admitted = (sizes[1:] <= budget) & drafter_admitted.index_select(0, chosen)[0]
    deepest = torch.where(admitted, pos.index_select(0, chosen)[0] + 1, 0)
    depth = deepest.max() if deepest.numel() else pos.new_zeros(())
    drafters = drafter.sum()
    rate = flat_ratio.take(best)
    curve = millis.index_select(0, chosen)[0]
    # ms per admitted draft on average (passes opened and verify-cost steps included), so a
    # staircase table does not make the next step's slope the price of every draft; with
    # nothing admitted, the marginal ms of the first draft.
    first = (
        cost.draft_pass.slope(drafters.clamp_min(1)).double() + cost.verify.slope(tokens).double()
    )
    average = (curve.take(budget) - curve[0]) / budget.clamp_min(1)
    marginal = torch.where(budget > 0, average, first)
    threshold = (rate * marginal).clamp(0.0, 1.0)
    return StepPlan(
        budget,
        depth.long(),
        threshold,
        expected.reshape(-1).take(best),
        curve.take(budget),
        millis[0, 0],
    )
