"""Tests for avspec.av.budget.plan_step: budget, depth and threshold on hand-computed cases.

With a zero draft-pass table (FREE_DRAFT) and rows not drafting adaptively, plan_step is the
verify-only budget of spec section 4: argmax_b (N + sum of the b best stale scores) /
(overhead + verify(T + b)). The draft side (section 6) is tested with per-pass draft costs.
"""

import pytest
import torch

from avspec.av.budget import StepPlan, plan_step
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost

FREE_DRAFT = CostTable([1], [0.0], name="draft_pass")
# Spec section 4 staircase: 1 ms with no drafts, 2 ms with one or two (T = 1 base token).
STAIRCASE = StepCost(FREE_DRAFT, CostTable([1, 2, 3], [1.0, 2.0, 2.0], name="verify"))


def _plan(
    stale,
    caps=None,
    adaptive=None,
    drafting=None,
    base=1,
    cost: StepCost = STAIRCASE,
) -> StepPlan:
    """plan_step on host lists; defaults: every position a candidate, adaptive, not drafting."""
    stale = torch.as_tensor(stale, dtype=torch.float32)
    batch, num_pos = stale.shape
    caps = [num_pos] * batch if caps is None else caps
    adaptive = [True] * batch if adaptive is None else adaptive
    drafting = [False] * batch if drafting is None else drafting
    return plan_step(
        stale,
        torch.tensor(caps, dtype=torch.int64),
        torch.tensor(adaptive, dtype=torch.bool),
        torch.tensor(drafting, dtype=torch.bool),
        base,
        cost,
    )


@pytest.mark.parametrize("drafting", [False, True])
@pytest.mark.parametrize(
    ("s2", "want"),
    [
        (0.3, 2),  # (1.8 + 0.3) / 2 = 1.05 > 1 > 0.9
        (0.1, 0),  # (1.8 + 0.1) / 2 = 0.95 < 1
    ],
)
def test_staircase_example_of_the_spec(s2, want, drafting):
    """Free draft passes: whether the row drafts adaptively changes nothing."""
    plan = _plan([[0.8, s2]], drafting=[drafting])
    for name in ("budget", "depth", "threshold", "expected_tokens", "expected_ms"):
        assert getattr(plan, name).shape == (), name
    assert plan.budget.dtype == torch.int64 and plan.depth.dtype == torch.int64
    assert plan.threshold.dtype == torch.float64
    assert int(plan.budget) == want
    assert float(plan.expected_tokens) == pytest.approx(1 + [0.0, 0.8, 0.8 + s2][want])
    assert float(plan.expected_ms) == [1.0, 2.0, 2.0][want]


def test_exact_tie_goes_to_smallest_budget():
    # (1 + 0.75 + 0.25) / 2 = 1.0 = ratio at b = 0 (exact in binary floating point)
    assert int(_plan([[0.75, 0.25]]).budget) == 0


def test_equal_scores_admit_the_earlier_position_first():
    """Ties among scores: the stable position-major order admits position 0 of both rows before
    position 1 of row 0 (a row-major order would give depth 2)."""
    cost = StepCost(FREE_DRAFT, CostTable([2, 3, 4, 5], [1.0, 1.1, 1.2, 3.0], name="verify"))
    # N = 2, T = 2: ratios 2 / 1, 2.5 / 1.1, 3 / 1.2 = 2.5, 3.5 / 3 -> b = 2.
    plan = _plan([[0.5, 0.5], [0.5, 0.0]], caps=[2, 1], drafting=[True, True], base=2, cost=cost)
    assert int(plan.budget) == 2
    assert int(plan.depth) == 1


def test_linear_cost_hand_computed():
    # N = 2, T = 2; ms[b] = 1 (overhead, the old fixed draft cost) + 1 + (2 + b) = 4 + b;
    # expected = 2, 2.9, 3.4, 3.5; ratios 0.5, 0.58, 0.567, 0.5 -> b = 1
    cost = StepCost(FREE_DRAFT, CostTable.linear(1.0, 1.0, 4, name="verify"), overhead_ms=1.0)
    stale = [[0.9, 0.5], [0.1, 0.1]]
    plan = _plan(stale, caps=[2, 1], base=2, cost=cost)
    assert int(plan.budget) == 1
    assert float(plan.expected_tokens) == pytest.approx(2.9)
    assert float(plan.expected_ms) == pytest.approx(5.0)
    # row order does not matter; base_tokens may be a 0-dim tensor
    swapped = _plan(stale[::-1], caps=[1, 2], base=torch.tensor(2), cost=cost)
    assert int(swapped.budget) == 1


def test_free_verification_takes_every_positive_score():
    cost = StepCost(FREE_DRAFT, CostTable([0], [1.0], name="verify"))
    # Three requests, one draft each: stale [n, 1].
    assert int(_plan([[0.5], [0.01], [0.2]], cost=cost).budget) == 3


def test_zero_cost_takes_every_positive_score():
    zero = CostTable([0], [0.0])
    plan = _plan([[0.5], [0.0]], cost=StepCost(zero, zero))
    assert int(plan.budget) == 1
    assert float(plan.threshold) == 0.0  # drafting costs nothing: every draft is worth it


@pytest.mark.parametrize("draft", [FREE_DRAFT, CostTable.linear(0.7, 0.2, 16, name="draft_pass")])
@pytest.mark.parametrize("verify", ["linear", "staircase"])
def test_padding_non_candidates_never_changes_the_plan(draft, verify):
    """Positions at or past a row's cap are not candidates whatever their stale value (0, 1 or
    anything): the plan equals the plan of the unpadded rows."""
    table = (
        CostTable.linear(2.0, 0.3, 32, name="verify")
        if verify == "linear"
        else CostTable([1, 2, 3], [1.0, 2.0, 2.0], name="verify")
    )
    cost = StepCost(draft, table)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        stale = torch.rand(3, 2, generator=gen).sort(-1, descending=True).values.cumprod(-1)
        drafting = (torch.rand(3, generator=gen) < 0.5).tolist()
        plain = _plan(stale, drafting=drafting, base=3, cost=cost)
        for fill in (0.0, 1.0, float(torch.rand((), generator=gen))):
            padded = torch.cat([stale, torch.full((3, 3), fill)], dim=1)
            other = _plan(padded, caps=[2, 2, 2], drafting=drafting, base=3, cost=cost)
            for name in ("budget", "depth", "threshold", "expected_tokens", "expected_ms"):
                assert torch.equal(getattr(other, name), getattr(plain, name)), name


def test_no_candidates_give_zero_budget_and_depth():
    """Nothing admitted: budget 0, and depth 0 (the next step drafts nothing adaptively)."""
    plan = _plan([[0.9, 0.8]] * 4, caps=[0] * 4, base=4)
    assert int(plan.budget) == 0 and int(plan.depth) == 0
    empty = _plan(torch.zeros(0, 3), base=0)
    assert int(empty.budget) == 0 and int(empty.depth) == 0


def test_non_adaptive_rows_verify_in_full_and_count_in_T():
    """Rows 0 and 2 are not adaptive (caps 3 and 3): their 6 drafts join T = 3 + 6 and their
    stale values (1.0) are no candidates. Adaptive row 1 has stale [0.8, 0.45].

    verify = 1 + 0.5 * tokens; N = 3. With T = 9: ratios 3 / 5.5, 3.8 / 6, 4.25 / 6.5 -> b = 2.
    With T = 3 (non-adaptive drafts forgotten) it would be 3 / 2.5, 3.8 / 3, 4.25 / 3.5 -> b = 1.
    """
    cost = StepCost(FREE_DRAFT, CostTable.linear(1.0, 0.5, 64, name="verify"))
    stale = [[1.0, 1.0, 1.0], [0.8, 0.45, 0.0], [1.0, 1.0, 1.0]]
    plan = _plan(stale, caps=[3, 2, 3], adaptive=[False, True, False], base=3, cost=cost)
    assert int(plan.budget) == 2
    assert float(plan.expected_tokens) == pytest.approx(4.25)
    assert float(plan.expected_ms) == pytest.approx(1.0 + 0.5 * 11)
    # Same as adaptive rows with no drafts and their drafts added to base_tokens.
    same = _plan(stale, caps=[0, 2, 0], base=9, cost=cost)
    for name in ("budget", "expected_tokens", "expected_ms"):
        assert torch.equal(getattr(same, name), getattr(plan, name)), name
    forgotten = _plan(stale, caps=[0, 2, 0], base=3, cost=cost)
    assert int(forgotten.budget) == 1  # the case tells T = 9 from T = 3


def test_non_adaptive_rows_pay_their_draft_passes():
    """A non-adaptive row drafts to its cap whatever the budget: its passes are in every ms."""
    cost = StepCost.linear(0.5, 0.25, 1.0, 0.1, 8, 64)
    alone = _plan([[0.9, 0.5]], drafting=[True], base=1, cost=cost)
    both = _plan(
        [[0.9, 0.5], [1.0, 1.0]], caps=[2, 2], adaptive=[True, False], drafting=[True, True],
        base=2, cost=cost,
    )  # fmt: skip
    # b = 0 for the pair: pass 0 over 2 tokens (1.0) + pass 1 with the full row (0.75) +
    # verify(2 + 2) (1.4) = 3.15 ms; the adaptive row's draft at position 1 joins pass 1 for
    # the row cost only (0.25 ms), where alone it opens the pass (0.75 ms).
    assert (int(both.budget), int(both.depth)) == (2, 2)
    assert float(both.expected_ms) == pytest.approx(1.0 + 0.75 + 0.25 + 1.0 + 0.1 * 6)
    # alone: ms = 0.75 + [0, 0, 0.75] + 1 + 0.1 (1 + b), expected 1, 1.9, 2.4 -> b = 1, D = 1
    assert (int(alone.budget), int(alone.depth)) == (1, 1)
    assert float(alone.expected_ms) == pytest.approx(0.75 + 1.0 + 0.1 * 2)


def test_per_pass_draft_cost_makes_the_plan_shallower():
    """One adaptive drafter, cap 4, stale [0.9, 0.8, 0.7, 0.6], base 1, verify 1 + 0.1 tokens.

    Free passes: every draft pays (b = 4, D = 4). At 0.5 ms per pass: ms[b] = 0.5 (pass 0) +
    0.5 * max(b - 1, 0) + 1 + 0.1 (1 + b); ratios 1/1.6, 1.9/1.7, 2.7/2.3, 3.4/2.9, 4/3.5 ->
    b = 2, D = 2. At 1 ms per pass: b = 1, D = 1.
    """
    stale = [[0.9, 0.8, 0.7, 0.6]]

    def plan(per_pass: float) -> StepPlan:
        cost = StepCost.linear(per_pass, 0.0, 1.0, 0.1, 8, 64)
        return _plan(stale, drafting=[True], cost=cost)

    free, half, full = plan(0.0), plan(0.5), plan(1.0)
    assert (int(free.budget), int(free.depth)) == (4, 4)
    assert (int(half.budget), int(half.depth)) == (2, 2)
    assert float(half.expected_tokens) == pytest.approx(2.7)
    assert float(half.expected_ms) == pytest.approx(2.3)
    assert (int(full.budget), int(full.depth)) == (1, 1)


def test_the_probabilities_hop_makes_the_plan_shallower_unless_it_is_sunk():
    """The same drafter with free passes and a hop of 0.5 ms per row and position: ms[b] =
    0.5 * max(b, 1) + 1 + 0.1 (1 + b); ratios 1/1.6, 1.9/1.7, 2.7/2.3, 3.4/2.9, 4/3.5 -> b = 2,
    D = 2. Beside a row drafting 4 to its cap the hop is 4 positions wide whatever the plan:
    every draft pays again."""
    stale = [[0.9, 0.8, 0.7, 0.6]]
    cost = StepCost.linear(0.0, 0.0, 1.0, 0.1, 8, 64, probs_row_ms=0.5)
    plan = _plan(stale, drafting=[True], cost=cost)
    assert (int(plan.budget), int(plan.depth)) == (2, 2)
    assert float(plan.expected_ms) == pytest.approx(2.3)
    beside = _plan(stale * 2, adaptive=[True, False], drafting=[True, False], base=2, cost=cost)
    assert (int(beside.budget), int(beside.depth)) == (4, 4)
    # 2 rows x 4 positions of hop, sunk: in the plan's ms with no admitted draft
    assert float(beside.base_ms) == pytest.approx(4.0 + 1.0 + 0.1 * 6)


def test_rows_not_drafting_adaptively_pay_their_full_passes():
    """The same row drafting to its cap pays every pass whatever the budget: the passes are
    sunk, so its budget is the verify-only budget (those passes as overhead) and D is 0."""
    stale = [[0.9, 0.8, 0.7, 0.6]]
    cost = StepCost.linear(0.5, 0.0, 1.0, 0.1, 8, 64)
    fixed = _plan(stale, drafting=[False], cost=cost)
    sunk = StepCost(FREE_DRAFT, cost.verify, overhead_ms=4 * 0.5)
    verify_only = _plan(stale, drafting=[False], cost=sunk)
    assert int(fixed.budget) == int(verify_only.budget) == 4
    assert float(fixed.expected_ms) == pytest.approx(float(verify_only.expected_ms))
    assert float(fixed.expected_ms) == pytest.approx(4 * 0.5 + 1.0 + 0.1 * 5)
    assert int(fixed.depth) == 0  # no adaptive drafter: nothing for the depth to allow
    drafter = _plan(stale, drafting=[True], cost=cost)
    assert int(drafter.budget) == 2 and float(drafter.expected_ms) < float(fixed.expected_ms)


@pytest.mark.parametrize(
    ("caps", "cost"),
    [
        ([2], StepCost.linear(5.0, 1.0, 50.0, 5.0, 8, 64)),  # drafts too dear: budget 0
        ([0], StepCost(FREE_DRAFT, CostTable([0], [1.0]))),  # no candidate at all
    ],
)
def test_depth_is_zero_when_nothing_is_admitted(caps, cost):
    """No admitted draft: D = 0, so the next step does not draw x_0 for its adaptive drafters
    (adaptive drafting falls back to no speculation)."""
    plan = _plan([[0.01, 0.001]], caps=caps, drafting=[True], cost=cost)
    assert int(plan.budget) == 0
    assert int(plan.depth) == 0


def test_the_next_plan_prices_the_pending_pass_it_would_defer():
    """for_next_step: a budget admitting no drafter's draft saves the pending pass (the draft
    defers it); here that saving tips the plan to no drafts, while the step's own budget (the
    pass ran already) still admits them."""
    stale = [[0.5, 0.2]] * 4
    cost = StepCost.linear(2.0, 2.0, 10.0, 1.0, 8, 64)  # pass 2 + 2 / row; verify 10 + 1 / token
    own = _plan(stale, drafting=[True] * 4, base=4, cost=cost)
    plan_step_next = _plan_next(stale, cost)
    assert int(own.budget) > 0 and int(own.depth) >= 1
    assert int(plan_step_next.budget) == 0 and int(plan_step_next.depth) == 0
    pending = cost.draft_pass.at(4)
    assert pending == pytest.approx(10.0)
    # own: 6 tokens / 28 ms > 4 / 24; next: 6 / 28 < 4 / 14 (no draw, no pending pass)
    assert float(plan_step_next.base_ms) == pytest.approx(float(own.base_ms) - pending)


def test_the_pending_pass_is_priced_by_its_own_table():
    """The pass over pending inputs is priced by pending_pass where the StepCost has one (the
    served refresh learns it apart from the decode passes): a dearer first pass tips the same
    batch from drafting to deferring, a cheaper one keeps it drafting."""
    stale = [[0.5, 0.2]] * 4
    cheap = StepCost.linear(0.5, 0.1, 10.0, 1.0, 8, 64)  # pass 0.5 + 0.1 / row
    # x_0 of all four: 6 tokens / (0.9 + 18) ms > 4 / 14 (no draw, the pass deferred)
    assert int(_plan_next(stale, cheap).budget) == 4
    dear = StepCost.linear(0.5, 0.1, 10.0, 1.0, 8, 64)
    dear.pending_pass = CostTable.linear(2.0, 2.0, 64, name="pending_pass")  # 10 ms at 4 tokens
    plan = _plan_next(stale, dear)  # 6 / (10 + 18) < 4 / 14
    assert int(plan.budget) == 0 and int(plan.depth) == 0
    drafted = _plan(stale, drafting=[True] * 4, base=4, cost=dear)  # the step's own: pass ran
    assert float(drafted.base_ms) - float(plan.base_ms) == pytest.approx(10.0)


def test_the_pending_pass_is_saved_only_where_no_row_draws_without_the_plan():
    """Without a drafted x_0 the plan saves the pending pass (the draft defers it) only when
    every row that would draft is a drafter: a row drafting to its cap runs that pass anyway."""
    cost = StepCost.linear(2.0, 2.0, 10.0, 1.0, 8, 64)
    low = [[0.01, 0.001]] * 3
    caps, adaptive = torch.full((3,), 1), torch.ones(3, dtype=torch.bool)  # x_0 only: no pass 1

    def base_ms(drafting, caps=caps):
        plan = plan_step(
            torch.tensor(low), caps, adaptive, torch.tensor(drafting), 3, cost,
            for_next_step=True,
        )  # fmt: skip
        return float(plan.base_ms)

    pending = cost.draft_pass.at(3)
    assert base_ms([True, True, True]) == pytest.approx(base_ms([True, True, False]) - pending)
    # a non-drafting row with no drafts to make (cap 0) does not run the pass either
    capped = torch.tensor([1, 1, 0])
    assert base_ms([True, True, False], capped) == pytest.approx(base_ms([True, True, True]))


def test_the_plan_may_stop_at_a_depth_the_score_order_would_pass():
    """A pass costs the same for 1 row as for 8 (a memory-bound GPU): 8 rows whose x_0 pays
    alone, and one confident row whose deep scores come first in the score order. Every prefix
    of that order that takes the x_0s opens passes 1..3 for one row: the budget's argmax over
    prefixes alone drafts nothing; over depth limits it drafts x_0 for all 8, depth 1."""
    flat = CostTable([1, 64], [3.0, 3.0], name="draft_pass")
    cost = StepCost(flat, CostTable([1, 64], [20.0, 20.0], name="verify"))
    # none: 9 / 20 = 0.45; x_0 alone: (9 + 0.99 + 8 x 0.35) / (20 + 3 + 3) = 0.49; the best
    # prefix of the score order (deep scores first, passes 1..3 opened): 15.7 / 35 = 0.449
    stale = torch.tensor([[0.99, 0.98, 0.97, 0.96]] + [[0.35, 0.05, 0.01, 0.0]] * 8)
    batch = stale.shape[0]
    plan = plan_step(
        stale, torch.full((batch,), 4), torch.ones(batch, dtype=torch.bool),
        torch.ones(batch, dtype=torch.bool), batch, cost, for_next_step=True,
    )  # fmt: skip
    assert int(plan.depth) == 1 and int(plan.budget) == batch
    # the same scores, the search over depths off (the step's own budget): all or nothing
    own = plan_step(
        stale, torch.full((batch,), 4), torch.ones(batch, dtype=torch.bool),
        torch.ones(batch, dtype=torch.bool), batch, cost,
    )  # fmt: skip
    assert int(own.depth) != 1


def _plan_next(stale, cost: StepCost) -> StepPlan:
    stale = torch.as_tensor(stale, dtype=torch.float32)
    batch, num_pos = stale.shape
    return plan_step(
        stale, torch.full((batch,), num_pos), torch.ones(batch, dtype=torch.bool),
        torch.ones(batch, dtype=torch.bool), batch, cost, for_next_step=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("cost", "drafting", "want"),
    [
        (StepCost.linear(1.0, 0.05, 2.0, 0.1, 8, 64), [True, True, False], None),
        (StepCost.linear(0.2, 0.3, 1.0, 0.4, 8, 64, overhead_ms=0.5), [True, False, True], None),
        (StepCost.linear(0.0, 0.0, 1.0, 0.0, 8, 64), [True, True, True], 0.0),  # free marginal
        # rate 3 / 1 at b = 0, marginal 10 ms per token: clamped to 1
        (StepCost(FREE_DRAFT, CostTable([0, 3, 4], [1.0, 1.0, 11.0])), [True, True, True], 1.0),
        (
            StepCost(
                CostTable([1, 2, 4], [1.0, 1.5, 1.6], name="draft_pass"),
                CostTable([3, 5, 9], [2.0, 2.2, 4.0], name="verify"),
            ),
            [True, True, False],
            None,
        ),
    ],
)
def test_threshold_is_rate_times_marginal_cost_in_unit_interval(cost, drafting, want):
    """tau = clamp((expected tokens / ms at the budget) * (ms per admitted draft on average), 0,
    1); with nothing admitted, the marginal ms of a first draft (draft ms per row at the
    drafters' count + verify ms per token at T)."""
    stale = [[0.95, 0.7, 0.4], [0.8, 0.6, 0.3], [0.5, 0.2, 0.1]]
    plan = _plan(stale, drafting=drafting, base=3, cost=cost)
    assert 0.0 <= float(plan.threshold) <= 1.0
    rate = float(plan.expected_tokens) / float(plan.expected_ms)
    budget = int(plan.budget)
    if budget:
        marginal = (float(plan.expected_ms) - float(plan.base_ms)) / budget
    else:
        drafters = max(sum(drafting), 1)
        marginal = float(cost.draft_pass.slope(drafters)) + float(cost.verify.slope(3))
    assert float(plan.threshold) == pytest.approx(min(max(rate * marginal, 0.0), 1.0))
    if want is not None:
        assert float(plan.threshold) == want


def test_threshold_for_linear_costs_by_hand():
    """One drafter, cap 2, stale [0.9, 0.5], base 1; draft 1 + 0.2 rows, verify 2 + 0.3 tokens.

    ms[b] = 1.2 (pass 0) + [0, 0, 1.2][b] + 2 + 0.3 (1 + b); expected 1, 1.9, 2.4:
    ratios 1/3.5, 1.9/3.8 = 0.5, 2.4/5.3 -> b = 1; the admitted draft cost 3.8 - 3.5 = 0.3 ms
    (x_0 opens no pass), tau = 0.5 * 0.3 = 0.15.
    """
    cost = StepCost.linear(1.0, 0.2, 2.0, 0.3, 8, 64)
    plan = _plan([[0.9, 0.5]], drafting=[True], cost=cost)
    assert (int(plan.budget), int(plan.depth)) == (1, 1)
    assert float(plan.threshold) == pytest.approx(0.15)
    assert float(plan.base_ms) == pytest.approx(3.5)


def test_threshold_on_a_staircase_is_not_the_next_steps_slope():
    """Verify 2 ms flat up to 4 tokens, then 1.5 ms per token: the budget stops before the
    stair, and tau prices what the admitted drafts cost (0 here), not the stair above them."""
    stair = CostTable([0, 4, 8], [2.0, 2.0, 8.0], name="verify")
    cost = StepCost(FREE_DRAFT, stair)
    plan = _plan([[0.9, 0.8, 0.7]], drafting=[True], base=1, cost=cost)
    assert int(plan.budget) == 3
    assert float(plan.threshold) == pytest.approx(0.0)


def test_result_stays_on_the_device_of_the_scores():
    plan = _plan([[0.9, 0.5]], drafting=[True])
    for name in ("budget", "depth", "threshold", "expected_tokens", "expected_ms"):
        assert getattr(plan, name).device == torch.device("cpu")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"stale": torch.zeros(2)}, "stale must have shape"),
        ({"num_draft_tokens": torch.tensor([1, 1])}, "num_draft_tokens must have shape"),
        ({"adaptive": torch.tensor([True, True])}, "adaptive must have shape"),
        ({"adaptive_drafting": torch.tensor([[True]])}, "adaptive_drafting must have shape"),
        ({"num_draft_tokens": torch.tensor([1], device="meta")}, "share one device"),
        ({"adaptive": torch.tensor([True], device="meta")}, "share one device"),
    ],
)
def test_rejects_bad_input(change, match):
    args = {
        "stale": torch.ones(1, 2),
        "num_draft_tokens": torch.tensor([2]),
        "adaptive": torch.tensor([True]),
        "adaptive_drafting": torch.tensor([False]),
        "base_tokens": 1,
        "cost": STAIRCASE,
    } | change
    with pytest.raises(ValueError, match=match):
        plan_step(**args)
