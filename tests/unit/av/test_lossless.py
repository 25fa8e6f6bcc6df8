"""Losslessness of the whole draft -> trim -> verify step, measured in a tiny synthetic world.

World: vocab V = 4, K = 2 drafts. The 'draft model' and 'target model' are fixed conditional
tables Q[prev] and P[prev] (the next-token distribution depends on the previous token only);
each request starts from a context token. One step per trial, vectorised over trials:

1. draft x1 ~ Q[context], x2 ~ Q[x1];
2. confidences c_i = sigmoid(w * logit_qmax(q_i) + b_i) (q_i depends on x_<i only), survival;
3. a budget: `plan_step` on the PREVIOUS step's survival values (an independent earlier draw of
   the same requests: the real pipeline's stale scores), `plan_step` on THIS step's values
   (broken), or fixed. Every request is adaptive and drafts to its cap (adaptive_drafting off),
   with a zero draft-pass table: the verify-only budget of spec section 4;
4. top-budget admission (avspec.av.survival), then rejection sampling (avspec.engine.rejection);
5. the first two emitted tokens (y1, y2); if only y1 was emitted, y2 is drawn from P[y1], which is
   what the target alone samples next.

The exact law is P[context][y1] * P[y1][y2]. A chi-square test over the 16 (y1, y2) cells per
request gives a p-value: the correct pipeline must give p > 1e-4 for every request (200k trials),
each broken variant p < 1e-6 for the request it biases (50k trials). All runs are seeded.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from avspec.av.budget import plan_step
from avspec.av.cost_table import CostTable
from avspec.av.features import logit_qmax
from avspec.av.step_cost import StepCost
from avspec.av.survival import admit, survival
from avspec.engine.rejection import rejection_sample

V, K = 4, 2
PASS, FAIL = 1e-4, 1e-6


@dataclass
class World:
    """Conditional tables P, Q [V, V] (rows: previous token), requests, estimator-like map."""

    target: torch.Tensor  # [V, V]
    draft: torch.Tensor  # [V, V]
    contexts: list[int]  # one context token per request
    num_draft_tokens: list[int]
    slope: float
    intercepts: list[float]  # [K]


def _confidences(world: World, q_rows: torch.Tensor, drafts: torch.Tensor, sampled: bool):
    """c [..., batch, K] from q rows [..., batch, K, V]; `sampled` reads q(x_i): the broken rule."""
    if sampled:
        q_x = q_rows.gather(-1, drafts[..., None]).squeeze(-1)
        feature = torch.log(q_x / (1 - q_x))
    else:
        flat = q_rows.reshape(-1, K, V)
        feature = logit_qmax(flat.log(), 1.0).reshape(q_rows.shape[:-1])
    return torch.sigmoid(world.slope * feature + torch.tensor(world.intercepts))


def _q_rows(world: World, x1: torch.Tensor) -> torch.Tensor:
    """q at positions 0 and 1, [..., batch, K, V], given x1 [..., batch]."""
    context = torch.tensor(world.contexts).expand_as(x1)
    return torch.stack([world.draft[context], world.draft[x1]], dim=-2)


def _budget_table(world: World, cost: StepCost, base: int):
    """plan_step's budget for each combination of the requests' x1 (index sum x1_r V^r), from
    the survival rows [batch, K] that combination gives."""
    batch = len(world.contexts)
    combos = torch.tensor(list(itertools.product(range(V), repeat=batch))).flip(-1)
    conf = _confidences(world, _q_rows(world, combos), combos, sampled=False)
    caps = torch.tensor(world.num_draft_tokens)
    values, _ = survival(conf, caps.expand(len(combos), batch))
    adaptive = torch.ones(batch, dtype=torch.bool)
    fixed_drafting = torch.zeros(batch, dtype=torch.bool)
    return torch.stack(
        [plan_step(v, caps, adaptive, fixed_drafting, base, cost).budget for v in values]
    )


def _combo(x1: torch.Tensor) -> torch.Tensor:
    return (x1 * V ** torch.arange(x1.shape[-1])).sum(-1)


def _draw(table_rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    flat = table_rows.reshape(-1, V)
    return torch.multinomial(flat, 1, generator=gen).reshape(table_rows.shape[:-1])


def run_step(
    world: World,
    trials: int,
    seed: int,
    *,
    budget_mode: str,
    sampled_feature: bool = False,
    costs: tuple[StepCost, int] | None = None,
    fixed_budget: int = 0,
) -> torch.Tensor:
    """Counts [batch, V, V] of the first two emitted tokens over `trials` seeded trials."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(world.contexts)
    context = torch.tensor(world.contexts).expand(trials, batch)
    x1 = _draw(world.draft[context], gen)
    x2 = _draw(world.draft[x1], gen)
    drafts = torch.stack([x1, x2], dim=-1)  # [trials, batch, K]
    q_rows = _q_rows(world, x1)  # [trials, batch, K, V]
    p_rows = torch.stack([world.target[context], world.target[x1], world.target[x2]], dim=-2)

    conf = _confidences(world, q_rows, drafts, sampled_feature)
    values, candidates = survival(conf, torch.tensor(world.num_draft_tokens).expand(trials, batch))
    if budget_mode == "fixed":
        budget = torch.full((trials,), fixed_budget)
    else:
        table = _budget_table(world, *costs)
        previous_x1 = _draw(world.draft[context], gen)  # last step's drafts: independent of x1
        budget = table[_combo(previous_x1 if budget_mode == "stale" else x1)]
        if budget_mode == "current" and not sampled_feature:
            # The table is plan_step on this step's own survival rows (spot-checked).
            cost, base = costs
            caps = torch.tensor(world.num_draft_tokens)
            on = torch.ones(batch, dtype=torch.bool)
            for t in range(min(trials, 32)):
                plan = plan_step(values[t], caps, on, ~on, base, cost)
                assert int(plan.budget) == int(budget[t])
    num_verify = admit(values, candidates, budget)  # [trials, batch]

    rows = trials * batch
    out, accepted = rejection_sample(
        drafts.reshape(rows, K),
        q_rows.reshape(rows, K, V),
        p_rows.reshape(rows, K + 1, V),
        num_verify.reshape(rows),
        noise=(
            torch.rand(rows, K, generator=gen),
            torch.rand(rows, generator=gen, dtype=torch.float64),
        ),
        check_values=False,  # 200k trials a call: the ranges hold by construction
    )
    y1 = out[:, 0].long()
    y2 = torch.where(accepted > 0, out[:, 1].long(), _draw(world.target[y1], gen))
    cells = (y1 * V + y2).reshape(trials, batch)
    counts = torch.stack([torch.bincount(cells[:, r], minlength=V * V) for r in range(batch)])
    return counts.reshape(batch, V, V).double()


def p_values(world: World, counts: torch.Tensor) -> list[float]:
    """Chi-square p-value per request against P[context][y1] * P[y1][y2]."""
    result = []
    for r, context in enumerate(world.contexts):
        exact = world.target[context][:, None].double() * world.target.double()
        expected = exact * counts[r].sum()
        if bool((counts[r][expected == 0] > 0).any()):
            result.append(0.0)  # a token the target can never emit
            continue
        live = expected > 0
        chi2 = ((counts[r][live] - expected[live]) ** 2 / expected[live]).sum()
        dof = torch.tensor(float(live.sum() - 1), dtype=torch.float64)
        result.append(float(torch.special.gammaincc(dof / 2, chi2 / 2)))
    return result


def _table(rows) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.float32)
    return t / t.sum(-1, keepdim=True)


# Three requests, different peakedness so confidences (and the stale budget) vary.
MIXED = World(
    target=_table([[5, 3, 1, 1], [1, 1, 6, 2], [2, 2, 2, 4], [1, 6, 1, 2]]),
    draft=_table([[8, 1, 0.5, 0.5], [1, 2, 5, 2], [1, 3, 3, 3], [0.2, 9, 0.4, 0.4]]),
    contexts=[0, 2, 3],
    num_draft_tokens=[2, 1, 2],
    slope=0.5,
    intercepts=[0.3, -0.2],
)
# A zero draft-pass table and a fixed 0.5 ms overhead: the budget is the verify-only one.
FREE_DRAFT = CostTable([1], [0.0], name="draft_pass")
MIXED_COSTS = (StepCost(FREE_DRAFT, CostTable.linear(1.0, 0.35, 16), overhead_ms=0.5), 3)


def test_correct_pipeline_matches_target_with_binding_stale_budget():
    """200k trials, 3 requests, stale budget: every request's p-value > 1e-4."""
    table = _budget_table(MIXED, *MIXED_COSTS)
    assert len(set(table.tolist())) >= 2 and int(table.min()) < 5  # varies and binds
    counts = run_step(MIXED, 200_000, seed=1, budget_mode="stale", costs=MIXED_COSTS)
    assert min(p_values(MIXED, counts)) > PASS


def test_correct_pipeline_with_fixed_budget():
    """200k trials, fixed budget 2 of 5 candidates: every request's p-value > 1e-4."""
    counts = run_step(MIXED, 200_000, seed=2, budget_mode="fixed", fixed_budget=2)
    assert min(p_values(MIXED, counts)) > PASS


# Spec footnote: p = [0.5, 0.5], q = [0.2, 0.8]. Request 1 always has confidence 0.5, so with
# budget 1 request 0's draft is verified iff its confidence beats 0.5.
FOOTNOTE = World(
    target=_table([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]),
    draft=_table([[2, 8, 0, 0], [1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]]),
    contexts=[0, 2],
    num_draft_tokens=[1, 1],
    slope=1.0,
    intercepts=[0.0, 0.0],
)


def test_trimming_on_sampled_token_probability_is_biased():
    """50k trials: confidence from logit q(x_sampled) -> P(y1 = a) = 0.4, p-value < 1e-6."""
    counts = run_step(FOOTNOTE, 50_000, seed=3, budget_mode="fixed", fixed_budget=1,
                      sampled_feature=True)  # fmt: skip
    assert p_values(FOOTNOTE, counts)[0] < FAIL
    first = counts[0].sum(-1) / counts[0].sum()
    assert abs(float(first[0]) - 0.4) < 0.01
    correct = run_step(FOOTNOTE, 50_000, seed=3, budget_mode="fixed", fixed_budget=1)
    assert min(p_values(FOOTNOTE, correct)) > PASS


# Spec section 4 staircase: one request, N = 1, cost 1 with no drafts and 2 with one or two,
# s1 = 0.8, s2 = 0.8 * c2(x1). Q[0] = [0.2, 0.8, 0, 0] like the footnote; after x1 = a the draft
# row is Q[0] again (c2 = 0.31, s2 = 0.25 > 0.2: verify both), after x1 = b it is flat
# (c2 = 0.11, s2 = 0.09: verify none). The current-step budget verifies x1 only when x1 = a, giving
# P(y1 = a) = 0.2 + 0.8 * 0.5 = 0.6 instead of 0.5.
STAIRCASE_WORLD = World(
    target=_table([[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]),
    draft=_table([[2, 8, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 1]]),
    contexts=[0],
    num_draft_tokens=[2],
    slope=0.5,
    intercepts=[0.5 * 1.3862944, -1.5],  # c1 = sigmoid(0.5 logit 0.8 + 0.69) = 0.8
)
STAIRCASE_COSTS = (StepCost(FREE_DRAFT, CostTable([1, 2, 3], [1.0, 2.0, 2.0])), 1)


def test_staircase_current_budget_is_biased():
    """50k trials: budget from this step's survival -> p-value < 1e-6 (P(y1 = a) ~ 0.6)."""
    assert _budget_table(STAIRCASE_WORLD, *STAIRCASE_COSTS)[:2].tolist() == [2, 0]
    counts = run_step(STAIRCASE_WORLD, 50_000, seed=4, budget_mode="current",
                      costs=STAIRCASE_COSTS)  # fmt: skip
    assert p_values(STAIRCASE_WORLD, counts)[0] < FAIL
    first = counts[0].sum(-1) / counts[0].sum()
    assert abs(float(first[0]) - 0.6) < 0.01


def test_staircase_stale_budget_is_lossless():
    """50k trials, same world and costs, budget from the previous step: p-value > 1e-4."""
    counts = run_step(STAIRCASE_WORLD, 50_000, seed=5, budget_mode="stale",
                      costs=STAIRCASE_COSTS)  # fmt: skip
    assert p_values(STAIRCASE_WORLD, counts)[0] > PASS
