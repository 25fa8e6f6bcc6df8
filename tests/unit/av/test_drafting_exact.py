"""Exact losslessness of adaptive drafting + adaptive verification, by enumeration in Fractions.

World: vocabulary V = 3, two requests, K = 3 draft positions. The draft q(. | r, prefix) and the
target p(. | r, prefix) are fixed rational tables (DRAFT, TARGET) keyed by the request and the last
token of the step: every entry positive, q != p at every prefix. One speculative step is
enumerated branch by branch,
each branch carrying its exact probability (fractions.Fraction); every decision is taken by the
library (avspec.av.drafting, avspec.av.survival) on float tensors, as the engine takes it:

1. the plan, fixed before the step: a `DraftPlan` (slope, intercepts, tau = TAU, and depth D) and
   the budget b, D and b from plan_step(STALE, ...) on fixed stale survival values and a staircase
   `StepCost` (the verify table jumps when the first draft is verified, is flat, jumps again at the
   fourth: CUDA-graph buckets);
2. drafting: `draft_limits` gives each row its limit; at pass i every active row has its feature
   f_i = logit q_max of q(. | x_<i) (a float), c_i = `stop_confidence`, s_i = s_{i-1} * c_i, and
   draws x_i ~ q (all 3^rows draws enumerated); it drafts past i only while `keeps_drafting(s_i)`
   (and i + 1 < its limit), so the last drafted token is the one at which it stopped;
3. admission: fresh survival values of the drafted positions (`survival`), `admit(values,
   candidates, b)` for num_verify per row;
4. rejection sampling, exact: admitted x_i is accepted with probability min(1, p(x_i) / q(x_i)); on
   the first rejection a token is emitted from the normalised residual (p - q)+; if every admitted
   draft is accepted a bonus token is emitted from p at the next position;
5. completion: each request's emitted tokens are extended to L = K + 1 tokens from p.

Why completion to L: a step emits a variable number N of tokens (1 to K + 1), so the emitted block
alone has no fixed-length law to compare with p's. Speculative sampling is exact in this sense:
each emitted token has law p given the tokens before it, and N is a stopping time of the emitted
sequence (whether the block goes on past its i-th token is settled by what was drawn up to then,
never by what comes after). The block followed by tokens from p is then one autoregressive run of
p, so its law over any fixed horizon L >= N is p's. A decision that peeks at a draft it should not
(its own q(x_i), or a stop or budget that moved with it) breaks this and moves the completed law.
L = K + 1 is the longest block a step can emit, so every branch is completed to the same horizon.

The criterion is exact: the joint law over both requests of the completed sequences (3^4 * 3^4
outcomes) must equal the product of the target's laws, Fraction for Fraction. The same harness
with one hook swapped (`Hooks`) shows a non-zero bias for each unsafe rule of spec sections 4 and
6: a batch-level stop from this step's survival values, a budget from this step's survival values
(the staircase example), a normalisation of the features by this step's batch mean, and dropping a
draft because of q(x_i) of the sampled token. Comparing a row's survival with the other row's at
the same position is, by contrast, exact (test below): it only ever removes drafts that rank below
every draft they could depend on. About 2 s in all (at most 3^6 draft branches per run).

A reduced draft vocabulary (avspec.engine.draft_vocab) is the same harness with another q: the
draft computes its logits for the map's kept ids only and the library's `scatter_kept` puts them
into a full-width row with -inf elsewhere, so q is 0 outside the map (`Hooks.draw`), and the
feature is logit q_max of that q. Verification runs over the full vocabulary: a token outside
the map is never drafted and comes only from the residual or the bonus. The joint law must
still equal the target's exactly; three broken maps (`Hooks.draw` != `Hooks.report`:
verification told a q other than the one the drafts were drawn from) must move it, while a map
that is wrong but reported consistently stays exact.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fractions import Fraction

import pytest
import torch

from avspec.av.budget import plan_step
from avspec.av.cost_table import CostTable
from avspec.av.drafting import DraftPlan, draft_limits, keeps_drafting, stop_confidence
from avspec.av.step_cost import StepCost
from avspec.av.survival import admit, survival
from avspec.engine.draft_vocab import DraftVocab, scatter_kept

pytestmark = pytest.mark.usefixtures("single_thread")

V, B, K = 3, 2, 3
L = K + 1  # completion horizon: the longest block one step can emit
CAPS = [3, 3]  # num_draft_tokens per request
ADAPTIVE = [True, True]  # both compete in the top-k and stop by the plan
SEQ_IDS = [1, 2]  # the requests' ids (a probe takes the multiples of its stride)
BASE_TOKENS = B  # one token per decoding request is verified anyway

Seq = tuple[int, ...]
Dist = tuple[Fraction, ...]
Law = dict[Seq, Fraction]

# Staircase, as CUDA-graph padding makes it: verifying the first draft costs a jump (4 -> 6 ms),
# the next two are free, the fourth jumps again (-> 7.5 ms), then flat. A draft pass costs 0.5 ms
# per row. With the second step the stale budget stops at 3 of 6 candidates (with a single step a
# free position-0 candidate always follows, and the budget never ends on a deep draft).
STAIRCASE = StepCost(
    draft_pass=CostTable([1, 2], [0.5, 1.0], name="draft_pass"),
    verify=CostTable([2, 3, 5, 6, 9], [4.0, 6.0, 6.0, 7.5, 7.5], name="verify"),
)
# Last step's survival values (fixed: they are not this step's draws): plan_step gives budget 3
# (request 1's three drafts) and depth D = 3.
STALE = torch.tensor([[0.5, 0.2, 0.1], [0.9, 0.8, 0.7]])
# Coefficients of the plan: c = sigmoid(f + 0.8) is 0.899 where q_max = 4/5 and 0.597 where
# q_max = 2/5. Request 1 mostly has s = 0.899, 0.808, 0.727; request 0 has s_0 = 0.597 and
# s_1 = 0.537 after x_0 = 0, 0.356 otherwise.
SLOPE, INTERCEPTS = 1.0, (0.8, 0.8, 0.8)
# tau is set by hand: it binds between request 0's two values of s_1 (request 0 drafts x_2 only
# after x_0 = 0). plan_step's own tau prices the next verify step (1.5 ms a token) and is 1.0 here.
TAU = 0.45


# --- the toy models ----------------------------------------------------------------------------


# The toy models are Markov in the step's own tokens: the row of a table is the last token drafted
# or emitted in this step (None at the step's first position; the request's context is fixed).
# Request 0 is unsure (q_max 2/5) except after token 0, where it is confident (q_max 4/5), so its
# survival at position 1 moves with x_0. Request 1 is confident (q_max 4/5) except after token 2.
DRAFT = (
    {None: (2, 2, 1), 0: (8, 1, 1), 1: (2, 1, 2), 2: (1, 2, 2)},
    {None: (1, 8, 1), 0: (8, 1, 1), 1: (1, 8, 1), 2: (2, 2, 1)},
)
TARGET = (
    {None: (3, 1, 1), 0: (4, 3, 3), 1: (1, 3, 1), 2: (2, 1, 2)},
    {None: (1, 3, 1), 0: (3, 1, 1), 1: (2, 5, 3), 2: (1, 1, 3)},
)


def _row(table: dict[int | None, tuple[int, ...]], prefix: Seq) -> Dist:
    weights = table[prefix[-1] if prefix else None]
    return tuple(Fraction(w, sum(weights)) for w in weights)


def _q(request: int, prefix: Seq) -> Dist:
    """Draft distribution q(. | request, prefix)."""
    return _row(DRAFT[request], prefix)


def _p(request: int, prefix: Seq) -> Dist:
    """Target distribution p(. | request, prefix)."""
    return _row(TARGET[request], prefix)


def _feature(request: int, prefix: Seq, draw: str = "full") -> float:
    """f = logit q_max of the q drafts are drawn from, q(. | x_<i): known before x_i is drawn."""
    qmax = max(DRAFTS[draw](request, prefix))
    return math.log(qmax / (1 - qmax))


# A reduced draft vocabulary: the map keeps ids 1 and 2; id 0, to which the target gives 3/5 of
# request 0's first token and 1/5 to 3/5 at every other prefix, is never drafted. The draft
# computes the kept ids' logits, log w(id) of the DRAFT weights, and the library scatters them
# into a full row, -inf elsewhere: softmax is then w / (sum of the kept w) at the finite entries
# and 0 at the -inf ones, computed here exactly. q_max is larger than the full draft's, so the
# plan's tau is raised to keep the per-request stop binding (after request 0's x_0 = 2).
DRAFT_VOCAB = DraftVocab.of([1, 2], V)
KEPT = torch.tensor(DRAFT_VOCAB.token_ids)
TAU_REDUCED = 0.6
# A broken map: the scatter puts the kept ids' logits one id too low (1 -> 0, 2 -> 1).
MISPLACED = KEPT - 1


def _scattered(request: int, prefix: Seq, index: torch.Tensor) -> Dist:
    """softmax of the kept ids' logits scattered by `scatter_kept` to the ids `index`."""
    weights = DRAFT[request][prefix[-1] if prefix else None]
    kept = torch.tensor([float(weights[t]) for t in DRAFT_VOCAB.token_ids], dtype=torch.float64)
    row = scatter_kept(kept, index, V).tolist()  # integer weights: exact in float64
    mass = [Fraction(int(x)) if math.isfinite(x) else Fraction(0) for x in row]
    return tuple(m / sum(mass) for m in mass)


def _q_reduced(request: int, prefix: Seq) -> Dist:
    """q of the draft with the map: 0 outside the kept ids."""
    return _scattered(request, prefix, KEPT)


def _q_misplaced(request: int, prefix: Seq) -> Dist:
    """q of a draft whose scatter puts the kept ids' logits at the wrong ids."""
    return _scattered(request, prefix, MISPLACED)


DRAFTS: dict[str, Callable[[int, Seq], Dist]] = {
    "full": _q,
    "reduced": _q_reduced,
    "misplaced": _q_misplaced,
}


# --- exact laws ----------------------------------------------------------------------------------


def _accumulate(law: Law, weight: Fraction, sub: Law) -> None:
    if weight:
        for seq, prob in sub.items():
            law[seq] = law.get(seq, Fraction(0)) + weight * prob


@functools.cache
def _target_law(request: int, prefix: Seq) -> Law:
    """Law of the length-L sequence sampled from p autoregressively after `prefix`."""
    if len(prefix) == L:
        return {prefix: Fraction(1)}
    law: Law = {}
    for token, prob in enumerate(_p(request, prefix)):
        _accumulate(law, prob, _target_law(request, prefix + (token,)))
    return law


def _residual(p: Dist, q: Dist) -> Dist:
    """Normalised (p - q)+ (only reached on a rejection, so p != q and the mass is positive)."""
    excess = [max(pi - qi, Fraction(0)) for pi, qi in zip(p, q, strict=True)]
    total = sum(excess)
    return tuple(e / total for e in excess)


def _accept(p: Fraction, q: Fraction) -> Fraction:
    """P(u q < p) for u ~ U[0, 1), the rejection sampler's test: 1 where q = 0 < p."""
    return Fraction(int(p > 0)) if q == 0 else min(Fraction(1), p / q)


@functools.cache
def _verified_law(request: int, admitted: Seq, report: str = "full") -> Law:
    """Completed law of one request given its admitted drafts (prefix x_<i), verified against
    the q named `report` (the q they were drawn from, unless the variant is broken)."""
    law: Law = {}
    prefix: Seq = ()
    reach = Fraction(1)  # probability that every admitted draft so far was accepted
    for token in admitted:
        p, q = _p(request, prefix), DRAFTS[report](request, prefix)
        accept = _accept(p[token], q[token])
        if accept < 1:
            for t, prob in enumerate(_residual(p, q)):
                _accumulate(law, reach * (1 - accept) * prob, _target_law(request, prefix + (t,)))
        reach *= accept
        prefix += (token,)
    for t, prob in enumerate(_p(request, prefix)):  # bonus token
        _accumulate(law, reach * prob, _target_law(request, prefix + (t,)))
    return law


# --- the step, with hooks for the unsafe variants -------------------------------------------------


@dataclass(frozen=True)
class Pass:
    """What a stop rule sees after pass `position`: the rows that drafted it and their s_i."""

    position: int
    rows: list[int]
    survival: torch.Tensor  # [rows] float32 s_i
    stops: torch.Tensor  # [rows] bool: the row stops by the plan
    room: torch.Tensor  # [rows] bool: position + 1 < the row's limit
    plan: DraftPlan


@dataclass(frozen=True)
class Drafted:
    """What the budget sees after drafting: fresh survival values of the drafted positions."""

    values: torch.Tensor  # [B, K] float32
    candidates: torch.Tensor  # [B, K] bool
    counts: torch.Tensor  # [B] int64: drafts per row


def _features_as_is(features: torch.Tensor) -> torch.Tensor:
    return features


def _keep_by_plan(ctx: Pass) -> torch.Tensor:
    """The safe per-request stop: `keeps_drafting` for rows stopping by the plan."""
    by_plan = torch.where(ctx.stops, keeps_drafting(ctx.survival, ctx.plan), True)
    return ctx.room & by_plan


def _never_drop(request: int, prefix: Seq, token: int) -> bool:
    return False


def _stale_budget(drafted: Drafted, stale_budget: int) -> int:
    return stale_budget


@dataclass(frozen=True)
class Hooks:
    """The decisions a variant may change; the defaults are the safe pipeline."""

    features: Callable[[torch.Tensor], torch.Tensor] = _features_as_is  # f_i of a pass's rows
    keep: Callable[[Pass], torch.Tensor] = _keep_by_plan  # which rows draft past the pass
    drop: Callable[[int, Seq, int], bool] = _never_drop  # discard a just-drawn draft
    budget: Callable[[Drafted, int], int] = _stale_budget  # budget given the stale one
    draw: str = "full"  # DRAFTS: the q each draft is drawn from (and its feature)
    report: str = "full"  # DRAFTS: the q verification is told (the drawn one when sound)


@dataclass(frozen=True)
class Branch:
    """One branch of the drafting loop: the rows' drafts so far and its probability."""

    drafts: tuple[Seq, ...]
    confidences: tuple[tuple[float, ...], ...]
    survival: tuple[float, ...]  # running s of each row (float32 values)
    active: tuple[int, ...]  # rows still drafting
    prob: Fraction


@dataclass
class StepLaw:
    """The enumerated step: the weight of each pair of admitted prefixes, and what bound."""

    weights: dict[tuple[Seq, Seq], Fraction] = field(default_factory=dict)
    stopped_early: bool = False  # some row drafted fewer than its limit (the stop bound)
    trimmed: bool = False  # some branch admitted fewer drafts than it drafted (the budget bound)
    budgets: set[int] = field(default_factory=set)  # budgets used
    verified: set[tuple[int, ...]] = field(default_factory=set)  # num_verify per row
    draw: str = "full"  # Hooks.draw and Hooks.report of the run
    report: str = "full"


def _stale_plan(tau: float = TAU) -> tuple[DraftPlan, int]:
    """The plan (depth D from `plan_step` on STALE, `tau`) and the stale budget."""
    flags = torch.tensor(ADAPTIVE)
    step = plan_step(STALE, torch.tensor(CAPS), flags, flags, BASE_TOKENS, STAIRCASE)
    return DraftPlan(tau, int(step.depth), SLOPE, INTERCEPTS), int(step.budget)


def _draft_pass(
    branch: Branch, position: int, plan: DraftPlan, limits: list[int], stops: list[bool],
    hooks: Hooks,
) -> list[Branch]:  # fmt: skip
    """Pass `position` of the drafting loop: every active row draws x_i, then stops or goes on."""
    rows = list(branch.active)
    features = torch.tensor(
        [_feature(r, branch.drafts[r], hooks.draw) for r in rows], dtype=torch.float32
    )
    conf = stop_confidence(hooks.features(features), position, plan)
    surv = torch.tensor([branch.survival[r] for r in rows], dtype=torch.float32) * conf
    ctx = Pass(
        position, rows, surv, torch.tensor([stops[r] for r in rows]),
        torch.tensor([position + 1 < limits[r] for r in rows]), plan,
    )  # fmt: skip
    keep = hooks.keep(ctx).tolist()  # from s_i: fixed before x_i is drawn
    out = []
    q = DRAFTS[hooks.draw]
    for tokens in itertools.product(range(V), repeat=len(rows)):
        drafts, confs, survs = list(branch.drafts), list(branch.confidences), list(branch.survival)
        prob, active = branch.prob, []
        for j, (r, token) in enumerate(zip(rows, tokens, strict=True)):
            prob *= q(r, branch.drafts[r])[token]
            if hooks.drop(r, branch.drafts[r], token):
                continue  # drawn, then discarded: the row stops without it
            drafts[r] += (token,)
            confs[r] += (float(conf[j]),)
            survs[r] = float(surv[j])
            if keep[j]:
                active.append(r)
        if prob:  # a token q never draws (outside a reduced vocabulary) opens no branch
            out.append(Branch(tuple(drafts), tuple(confs), tuple(survs), tuple(active), prob))
    return out


def _draft_branches(
    plan: DraftPlan, limits: list[int], stops: list[bool], hooks: Hooks
) -> list[Branch]:
    """Every branch of the drafting loop; it ends when no row is left or after K passes."""
    start = Branch(
        ((),) * B, ((),) * B, (1.0,) * B, tuple(r for r in range(B) if limits[r] > 0), Fraction(1)
    )
    open_, done = [start], []
    for position in range(K):
        following = []
        for branch in open_:
            if branch.active:
                following.extend(_draft_pass(branch, position, plan, limits, stops, hooks))
            else:
                done.append(branch)
        open_ = following
    return done + open_


def _admitted(branch: Branch, hooks: Hooks, stale_budget: int) -> tuple[tuple[Seq, ...], int]:
    """The admitted prefix of each row's drafts, and the budget used."""
    counts = torch.tensor([len(d) for d in branch.drafts])
    conf = torch.ones(B, K)
    for r, c in enumerate(branch.confidences):
        conf[r, : len(c)] = torch.tensor(c)
    values, candidates = survival(conf, counts)
    budget = hooks.budget(Drafted(values, candidates, counts), stale_budget)
    num_verify = admit(values, candidates, budget).tolist()
    return tuple(d[:n] for d, n in zip(branch.drafts, num_verify, strict=True)), budget


def step_law(
    hooks: Hooks, *, with_plan: bool = True, tau: float = TAU, plan: DraftPlan | None = None
) -> StepLaw:
    """Enumerate one step: weights of the admitted prefixes, and whether stop and budget bound.
    `plan` replaces the stale plan (its budget stays the stale one)."""
    stale_plan, stale_budget = _stale_plan(tau)
    plan = plan or stale_plan
    limits, stops = draft_limits(CAPS, ADAPTIVE, ADAPTIVE, plan if with_plan else None, SEQ_IDS)
    result = StepLaw(draw=hooks.draw, report=hooks.report)
    for branch in _draft_branches(plan, limits, stops, hooks):
        admitted, budget = _admitted(branch, hooks, stale_budget)
        key = (admitted[0], admitted[1])
        result.weights[key] = result.weights.get(key, Fraction(0)) + branch.prob
        result.budgets.add(budget)
        result.verified.add(tuple(len(a) for a in admitted))
        drafted = [len(d) for d in branch.drafts]
        result.stopped_early |= any(n < lim for n, lim in zip(drafted, limits, strict=True))
        result.trimmed |= sum(len(a) for a in admitted) < sum(drafted)
    return result


def mismatches(law: StepLaw) -> tuple[int, Fraction]:
    """(outcomes whose joint probability differs from the target's, largest difference)."""
    first: dict[Seq, dict[Seq, Fraction]] = defaultdict(dict)
    for (a0, a1), weight in law.weights.items():
        _accumulate(first[a0], weight, _verified_law(1, a1, law.report))
    target0, target1 = _target_law(0, ()), _target_law(1, ())
    count, largest = 0, Fraction(0)
    for y0, t0 in target0.items():
        row: Law = defaultdict(Fraction)
        for a0, mixed in first.items():
            _accumulate(row, _verified_law(0, a0, law.report).get(y0, Fraction(0)), mixed)
        for y1, t1 in target1.items():
            gap = abs(row[y1] - t0 * t1)
            if gap:
                count, largest = count + 1, max(largest, gap)
    return count, largest


def first_draft_admission(law: StepLaw) -> list[Fraction]:
    """P(request 0's x_0 is admitted | x_0 = t) for each token t the draft can draw (constant
    when lossless)."""
    admitted = [Fraction(0)] * V
    for (a0, _), weight in law.weights.items():
        if a0:
            admitted[a0[0]] += weight
    return [a / q for a, q in zip(admitted, DRAFTS[law.draw](0, ()), strict=True) if q]


# --- the unsafe variants -------------------------------------------------------------------------

# Batch-level stop: the loop goes on while the active rows' summed s_i is worth a pass. After pass 1
# the sum is 0.808 + 0.537 (x_0 of request 0 was 0: go on) or 0.808 + 0.356 (stop): request 1's
# x_2, which outranks request 0's x_0, is drafted or not depending on that x_0.
GAIN_FLOOR = 1.25


def _keep_while_batch_gains(ctx: Pass) -> torch.Tensor:
    """UNSAFE: the loop ends when this step's summed survival drops below the pass's worth."""
    return _keep_by_plan(ctx) & (ctx.survival.sum() >= GAIN_FLOOR)


def _keep_above_other_rows(ctx: Pass) -> torch.Tensor:
    """Safe (exact below): a row stops when its s_i is below another row's s_i."""
    best = ctx.survival.max()
    return _keep_by_plan(ctx) & (ctx.survival >= best)


def _current_budget(drafted: Drafted, stale_budget: int) -> int:
    """UNSAFE: plan_step on this step's survival values (the spec's staircase example).

    After x_0 = 0 request 0's drafts are worth the second jump (budget 6), otherwise not (3): its
    x_0 is verified or not depending on x_0 itself.
    """
    flags = torch.tensor(ADAPTIVE)
    step = plan_step(drafted.values, drafted.counts, flags, flags, BASE_TOKENS, STAIRCASE)
    return int(step.budget)


def _batch_normalised(features: torch.Tensor) -> torch.Tensor:
    """UNSAFE: features centred on this step's batch mean at this position.

    Request 0's x_0 = 0 lowers request 1's centred feature at positions 1 and 2, whose survival
    then drops below request 0's s_0 and lets that x_0 into the budget.
    """
    return features - features.mean()


def _drop_unlikely_token(request: int, prefix: Seq, token: int) -> bool:
    """UNSAFE: discard the draft when q(x_i) of the sampled token is small."""
    return _q(request, prefix)[token] < Fraction(1, 4)


SAFE = Hooks()
UNSAFE = {
    "batch_gain_stop": replace(SAFE, keep=_keep_while_batch_gains),
    "current_budget": replace(SAFE, budget=_current_budget),
    "batch_normalised_features": replace(SAFE, features=_batch_normalised),
    "drop_on_sampled_q": replace(SAFE, drop=_drop_unlikely_token),
}


# --- tests ---------------------------------------------------------------------------------------


def test_toy_models_are_valid_and_different():
    """q and p are positive distributions at every prefix a step can reach, and q != p there."""
    for request in range(B):
        for length in range(L):
            for prefix in itertools.product(range(V), repeat=length):
                p, q = _p(request, prefix), _q(request, prefix)
                assert sum(p) == 1 and sum(q) == 1
                assert min(p) > 0 and min(q) > 0
                assert p != q, (request, prefix)
        assert sum(_target_law(request, ()).values()) == 1


def test_safe_pipeline_is_exact_with_stop_and_budget_binding():
    """Adaptive drafting + stale budget + rejection sampling: joint law == target's, exactly.

    Both the stop and the budget bind: some row stops before its limit K, some branch admits
    fewer drafts than it drafted, and the 3 admitted drafts go to either request by branch.
    """
    plan, stale_budget = _stale_plan()
    assert (plan.depth, stale_budget) == (K, 3)
    law = step_law(SAFE)
    assert sum(law.weights.values()) == 1
    assert law.stopped_early, "the per-request stop never bound"
    assert law.trimmed, "the budget never admitted fewer than were drafted"
    assert law.budgets == {stale_budget}
    assert {(0, 3), (1, 2)} <= law.verified, law.verified
    assert len(set(first_draft_admission(law))) == 1  # x_0's fate does not depend on x_0
    assert mismatches(law) == (0, 0)


def test_a_probe_of_some_requests_is_exact():
    """A plan of depth 0 whose probe takes request 2 only (stride 2): request 1 drafts nothing,
    request 2 draws x_0 and stops; which rows a probe takes is fixed by seq id before any draw,
    so the law stays exact."""
    stale, _ = _stale_plan()
    plan = replace(stale, depth=0, probe_stride=2)
    assert draft_limits(CAPS, ADAPTIVE, ADAPTIVE, plan, SEQ_IDS)[0] == [0, 1]
    law = step_law(SAFE, plan=plan)
    assert sum(law.weights.values()) == 1
    assert law.verified <= {(0, 0), (0, 1)} and (0, 1) in law.verified, law.verified
    assert mismatches(law) == (0, 0)


def test_fixed_drafting_without_plan_is_exact():
    """draft_limits(plan=None): every row drafts to its cap, and the law is exact too."""
    assert draft_limits(CAPS, ADAPTIVE, ADAPTIVE, None, SEQ_IDS) == (CAPS, [False] * B)
    law = step_law(SAFE, with_plan=False)
    assert sum(law.weights.values()) == 1
    assert not law.stopped_early and law.trimmed  # all 6 drafted, 3 admitted
    assert len(set(first_draft_admission(law))) == 1
    assert mismatches(law) == (0, 0)


def test_stop_by_comparing_rows_at_the_same_position_is_exact():
    """Stopping a row whose s_i is below another row's s_i: it binds, and the law stays exact.

    Row r is cut after pass i only when s^r_i < s^o_i, and s^o_i depends on x^o_k for k < i only.
    The drafts r loses have survival <= s^r_i < s^o_i <= s^o_k: they rank below every x^o_k the
    cut depends on, so whether x^o_k is admitted does not move. (A rule on the batch's sum, as in
    `_keep_while_batch_gains`, has no such order and is biased.)
    """
    law = step_law(replace(SAFE, keep=_keep_above_other_rows))
    baseline = step_law(SAFE)
    assert law.weights != baseline.weights  # the rule changed what was drafted and admitted
    assert mismatches(law) == (0, 0)


@pytest.mark.parametrize("name", sorted(UNSAFE))
def test_unsafe_variant_is_biased(name: str):
    """Each unsafe rule moves the probability of some completed outcome away from the target's."""
    law = step_law(UNSAFE[name])
    assert sum(law.weights.values()) == 1
    assert law.weights != step_law(SAFE).weights  # the rule changed what was admitted
    assert len(set(first_draft_admission(law))) > 1  # x_0's fate depends on x_0 itself
    count, largest = mismatches(law)
    assert count > 0 and largest > 0, name


# --- a reduced draft vocabulary ------------------------------------------------------------------

# Broken maps: verification is told a q other than the one the drafts were drawn from.
BROKEN_MAPS = {
    # the stage draws from the kept ids but reports q of the whole vocabulary (draft_probs taken
    # from logits the map was not applied to)
    "drawn_reduced_reported_full": replace(SAFE, draw="reduced", report="full"),
    # the scatter puts the kept ids' logits one id too low; q is reported for the intended ids
    "misplaced_scatter": replace(SAFE, draw="misplaced", report="reduced"),
    # the map applied to the reported q only: drafts drawn from the whole vocabulary
    "drawn_full_reported_reduced": replace(SAFE, draw="full", report="reduced"),
}


def test_reduced_draft_is_zero_outside_the_map():
    """The scatter gives q = 0 outside the kept ids, the kept ids' q renormalised, at every
    prefix a step can reach; the target keeps mass on the dropped id."""
    assert DRAFT_VOCAB.token_ids == (1, 2)
    for request in range(B):
        for length in range(K):
            for prefix in itertools.product((1, 2), repeat=length):
                full, reduced = _q(request, prefix), _q_reduced(request, prefix)
                assert reduced[0] == 0 and sum(reduced) == 1
                assert reduced[1] / reduced[2] == full[1] / full[2]
        assert _p(request, ())[0] > 0  # a target token the draft never proposes


@pytest.mark.parametrize("with_plan", [True, False], ids=["adaptive-drafting", "fixed-drafting"])
def test_reduced_draft_vocabulary_is_exact(with_plan: bool):
    """q = 0 outside the map, the feature from that q, verification over the full vocabulary:
    the joint law equals the target's exactly, with the stop (under the plan) and the budget
    binding and drafts of both requests verified."""
    law = step_law(replace(SAFE, draw="reduced", report="reduced"), with_plan=with_plan,
                   tau=TAU_REDUCED)  # fmt: skip
    assert sum(law.weights.values()) == 1
    assert all(0 not in a0 + a1 for a0, a1 in law.weights)  # id 0 is never drafted
    assert law.stopped_early == with_plan
    assert law.trimmed
    assert {(0, 3), (1, 2)} <= law.verified, law.verified
    assert len(set(first_draft_admission(law))) == 1
    assert mismatches(law) == (0, 0)


def test_a_consistent_but_wrong_map_is_still_exact():
    """A map that keeps other ids than intended, with q reported for the ids really drawn, only
    costs acceptance: rejection sampling is exact for any q the drafts were drawn from."""
    law = step_law(replace(SAFE, draw="misplaced", report="misplaced"), tau=TAU_REDUCED)
    assert law.weights != step_law(replace(SAFE, draw="reduced", report="reduced"),
                                   tau=TAU_REDUCED).weights  # fmt: skip
    assert mismatches(law) == (0, 0)


@pytest.mark.parametrize("name", sorted(BROKEN_MAPS))
def test_broken_map_is_biased(name: str):
    """Verification told a q other than the drawn one moves every completed outcome's law."""
    law = step_law(BROKEN_MAPS[name], tau=TAU_REDUCED)
    assert sum(law.weights.values()) == 1
    count, largest = mismatches(law)
    assert count > 0 and largest > Fraction(1, 10**4), (name, count, largest)
