"""Draft stage: drafts match full recomputation across accept/reject cycles; idle sweep; errors;
adaptive drafting by the previous step's plan (compact and masked modes)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers.stages import K, make_draft_stage, make_inputs, tiny_model

from avspec.av.drafting import DraftPlan
from avspec.contract import StepInputs
from avspec.engine.draft_stage import DraftOutput, DraftStage
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_probs(model: Transformer, context: list[int], drafts: list[int]) -> torch.Tensor:
    """softmax of full-recompute logits predicting each draft: [len(drafts), vocab]."""
    ids = torch.tensor([context + drafts[:-1]]) if drafts else torch.tensor([context])
    logits = model(ids)[0, len(context) - 1 :]
    return torch.softmax(logits.float(), dim=-1)


def test_drafts_match_full_recomputation_over_accept_reject_cycles() -> None:
    """Three sequences (K, 2 and 0 drafts) for 6 steps with random accept counts and tokens."""
    model = tiny_model(0)
    stage = make_draft_stage(model)
    rng = torch.Generator().manual_seed(1)
    seqs = {
        1: {"committed": [3, 1, 4, 1, 5], "n": K},
        2: {"committed": [9, 2], "n": 2},
        3: {"committed": [7], "n": 0},
    }
    pending = {s: (list(v["committed"]), 0) for s, v in seqs.items()}
    starts = dict.fromkeys(seqs, 0)
    for _ in range(6):
        rows = [
            {
                "seq_id": s,
                "tokens": pending[s][0],
                "start": starts[s],
                "reusable": pending[s][1],
                "n": v["n"],
                "seed": s,
            }  # fmt: skip
            for s, v in seqs.items()
        ]
        out = stage(make_inputs(rows))
        for r, (s, v) in enumerate(seqs.items()):
            n = v["n"]
            drafts = out.draft_tokens[r, :n].tolist()
            want = reference_probs(model, v["committed"], drafts)[:n]
            torch.testing.assert_close(out.draft_probs[r, :n], want, atol=1e-5, rtol=1e-4)
            assert (
                out.draft_probs[r, n:].abs().sum() == 0
                and out.draft_features[r, n:].abs().sum() == 0
            )
            assert stage.slots.held(s) == len(v["committed"]) + max(n - 1, 0)
            # a row that draws nothing while others draw defers its inputs: none are cached
            assert stage.cache.length(s) == (0 if n == 0 else stage.slots.held(s))
            accepted = int(torch.randint(0, n + 1, (), generator=rng))
            new = drafts[:accepted] + [int(torch.randint(0, 256, (), generator=rng))]
            starts[s] = len(v["committed"])
            v["committed"] += new
            pending[s] = (new, accepted)


def test_greedy_drafts_and_features() -> None:
    model = tiny_model(2)
    stage = make_draft_stage(model)
    context = [10, 20, 30]
    out = stage(make_inputs([{"seq_id": 5, "tokens": context, "temperature": 0.0}]))
    greedy = list(context)
    for _ in range(K):
        greedy.append(int(model(torch.tensor([greedy]))[0, -1].argmax()))
    assert out.draft_tokens[0].tolist() == greedy[3:]
    assert torch.all(out.draft_probs[0].max(dim=-1).values == 1.0)
    logits = model(torch.tensor([greedy[:-1]]))[0, 2:].float()
    z = logits - logits.max(dim=-1, keepdim=True).values
    qmax = 1 / torch.exp(z).sum(dim=-1)
    torch.testing.assert_close(
        out.draft_features[0],
        torch.log(qmax / (1 - qmax)).float().clamp(-40, 40),
        atol=1e-3,
        rtol=1e-3,
    )
    assert out.draft_tokens.dtype == torch.int32 and out.draft_probs.dtype == torch.float32


def test_draws_do_not_depend_on_the_batch() -> None:
    model = tiny_model(3)
    alone = make_draft_stage(model)(make_inputs([{"seq_id": 1, "tokens": [1, 2, 3], "seed": 42}]))
    rows = [
        {"seq_id": 7, "tokens": [9] * 6, "seed": 3},
        {"seq_id": 1, "tokens": [1, 2, 3], "seed": 42},
    ]
    batched = make_draft_stage(model)(make_inputs(rows))
    assert batched.draft_tokens[1].tolist() == alone.draft_tokens[0].tolist()
    torch.testing.assert_close(batched.draft_probs[1], alone.draft_probs[0])


def test_replayed_first_step_draws_the_same() -> None:
    model = tiny_model(4)
    stage = make_draft_stage(model)
    inputs = make_inputs([{"seq_id": 1, "tokens": [1, 2, 3], "seed": 5}])
    first = stage(inputs).draft_tokens.tolist()
    assert stage(inputs).draft_tokens.tolist() == first


def test_release_frees_cache() -> None:
    stage = make_draft_stage(tiny_model(5, layers=1))
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}, {"seq_id": 2, "tokens": [2]}]))
    assert stage.cache.has(1) and stage.cache.has(2)
    out = stage(make_inputs([], release=[1, 99]))
    assert out.draft_tokens.shape == (0, K)
    assert not stage.cache.has(1) and stage.cache.has(2)


def test_idle_timeout_frees_sequences_not_seen() -> None:
    now = [0.0]
    stage = make_draft_stage(tiny_model(6, layers=1), idle_timeout_s=10.0, clock=lambda: now[0])
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}, {"seq_id": 2, "tokens": [2]}]))
    now[0] = 8.0
    stage(make_inputs([{"seq_id": 2, "tokens": [5], "start": 1, "n": 1}]))
    now[0] = 15.0
    stage(make_inputs([{"seq_id": 2, "tokens": [5], "start": 2, "n": 1}]))
    assert not stage.cache.has(1), "sequence 1 idle for 15 s > 10 s"
    assert stage.cache.has(2), "sequence 2 was seen at 8 s and is in this step"
    with pytest.raises(ValueError, match="sequence 1 continues"):
        stage(make_inputs([{"seq_id": 1, "tokens": [5], "start": 1}]))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"n": K + 1}, "num_draft_tokens"),
        ({"n": -1}, "num_draft_tokens"),
        ({"reusable": 1}, "reusable"),
        ({"start": -1}, "start_positions"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"start": 3}, "continues"),
    ],
)
def test_bad_inputs(row: dict, match: str) -> None:
    stage = make_draft_stage(tiny_model(7, layers=1))
    with pytest.raises(ValueError, match=match):
        stage(make_inputs([{"seq_id": 1, "tokens": [1]} | row]))


def test_constructor_and_timeout_validation() -> None:
    model = tiny_model(8, layers=1)
    cache = model.new_cache(2, 16, "cpu", torch.float64)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        DraftStage(model, cache, 0)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        DraftStage(model, cache, K, idle_timeout_s=0)


# --- adaptive drafting: the plan of the previous step ---------------------------------------------

PLAN_ROWS = [
    {"seq_id": 1, "tokens": [3, 1, 4, 1, 5], "seed": 11, "adaptive": True},
    {"seq_id": 2, "tokens": [9, 2, 6], "seed": 12, "adaptive": True, "n": 3},
    {"seq_id": 3, "tokens": [7, 7], "seed": 13, "adaptive": True},
    {"seq_id": 4, "tokens": [2, 7, 1, 8], "seed": 14, "adaptive": True},
    {"seq_id": 5, "tokens": [5, 5, 5], "seed": 15, "adaptive": True},
]
CAPS = [K, 3, K, K, K]


class MaskedDraftStage(DraftStage):
    """The masked mode (the CUDA path: stopped rows keep running, drafting nothing) on the CPU."""

    @property
    def compact(self) -> bool:
        return False


def with_plan(inputs: StepInputs, plan: DraftPlan | None, drafting: list[bool]) -> StepInputs:
    """`inputs` with adaptive_drafting and the plan tensor (None: the empty tensor, no plan)."""
    return replace(
        inputs,
        adaptive_drafting=torch.tensor(drafting, dtype=torch.bool),
        draft_plan=plan.to_tensor() if plan is not None else torch.zeros(0),
    )


def generator_states(stage: DraftStage, seq_ids: list[int]) -> list[torch.Tensor]:
    return [g.get_state() for g in stage.slots.generators(seq_ids)]


def full_probs(out: DraftOutput) -> torch.Tensor:
    """draft_probs [batch, P, vocab] padded with zeros to [batch, K, vocab]."""
    return torch.nn.functional.pad(out.draft_probs, (0, 0, 0, K - out.draft_probs.shape[1]))


def assert_padding_past_num_drafted(out: DraftOutput) -> None:
    """Positions < num_drafted hold a draft (q sums to 1), later ones padding (all zero); q
    covers at least the positions drafted (P >= every num_drafted)."""
    assert int(out.num_drafted.max()) <= out.draft_probs.shape[1] <= K
    drafted = torch.arange(K) < out.num_drafted[:, None].long()  # [batch, K]
    probs = full_probs(out)
    torch.testing.assert_close(
        probs.sum(-1)[drafted], torch.ones(int(drafted.sum())), atol=1e-5, rtol=0
    )
    assert torch.equal(probs.sum(-1) > 0, drafted)
    assert out.draft_tokens[~drafted].abs().sum() == 0
    assert out.draft_features[~drafted].abs().sum() == 0


ALL = slice(None)


def assert_same_drafts(
    a: DraftOutput, b: DraftOutput, rows: slice = ALL, positions: slice = ALL
) -> None:
    for name in ("draft_tokens", "draft_probs", "draft_features"):
        got, want = getattr(a, name), getattr(b, name)
        if name == "draft_probs":
            got, want = full_probs(a), full_probs(b)
        assert torch.equal(got[rows, positions], want[rows, positions]), name


def test_zero_threshold_full_depth_plan_drafts_like_no_plan() -> None:
    """tau = 0 never stops a row (survival >= 0 even after underflow to 0; intercepts -30), depth
    K caps nothing: the same drafts, features, counts and generator use as without a plan."""
    model = tiny_model(10)
    inputs = make_inputs(PLAN_ROWS)
    plain_stage, planned_stage = make_draft_stage(model), make_draft_stage(model)
    plain = plain_stage(inputs)
    plan = DraftPlan(0.0, K, 1.0, (-30.0,) * K)
    planned = planned_stage(with_plan(inputs, plan, [True] * len(PLAN_ROWS)))
    assert_same_drafts(planned, plain)
    assert planned.num_drafted.tolist() == plain.num_drafted.tolist() == CAPS
    assert planned.num_drafted.dtype == torch.int32
    ids = [r["seq_id"] for r in PLAN_ROWS]
    for a, b in zip(
        generator_states(plain_stage, ids), generator_states(planned_stage, ids), strict=True
    ):
        assert torch.equal(a, b)
    assert_padding_past_num_drafted(planned)


def test_threshold_one_drafts_exactly_one_token_per_adaptive_row() -> None:
    """Confidences < 1 (slope 0.1, intercepts -1: features are clamped to +-40), so survival
    after x_0 is < tau = 1: each row drafts x_0 only, the same x_0 as without a plan, and no
    further pass runs (compact mode)."""
    model = tiny_model(10)
    inputs = make_inputs(PLAN_ROWS)
    plain = make_draft_stage(model)(inputs)
    plan = DraftPlan(1.0, K, 0.1, (-1.0,) * K)
    out = make_draft_stage(model)(with_plan(inputs, plan, [True] * len(PLAN_ROWS)))
    assert out.num_drafted.tolist() == [1] * len(PLAN_ROWS)
    assert_same_drafts(out, plain, positions=slice(0, 1))
    assert_padding_past_num_drafted(out)
    assert out.pass_ms.shape == (K,) and out.pass_ms.dtype == torch.float32
    assert out.pass_ms[0] > 0 and out.pass_ms[1:].abs().sum() == 0


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_depth_caps_the_drafts(depth: int) -> None:
    model = tiny_model(10)
    inputs = make_inputs(PLAN_ROWS)
    plain = make_draft_stage(model)(inputs)
    plan = DraftPlan(0.0, depth, 1.0, (0.0,) * K)
    out = make_draft_stage(model)(with_plan(inputs, plan, [True] * len(PLAN_ROWS)))
    assert out.num_drafted.tolist() == [min(cap, depth) for cap in CAPS]
    assert_same_drafts(out, plain, positions=slice(0, depth))
    assert_padding_past_num_drafted(out)
    assert torch.equal(out.pass_ms > 0, torch.arange(K) < depth)


def test_depth_zero_drafts_nothing_runs_no_output_layer_and_keeps_the_cache() -> None:
    """Plan D = 0 (the previous budget admitted nothing): adaptive drafters draft nothing and the
    output layer runs for row 1 alone (it drafts to its cap: not drafting adaptively); the
    pending tokens still reach the cache, so in the next step every row's q and feature at
    position 0 are those of a stage that drafted all along."""
    model = tiny_model(10)
    inputs = make_inputs(PLAN_ROWS)
    drafting = [True, False, True, True, True]
    stage, plain = make_draft_stage(model), make_draft_stage(model)
    rows_seen: list[int] = []
    logits = model.logits
    model.logits = lambda x: rows_seen.append(x.shape[0]) or logits(x)
    try:
        out = stage(with_plan(inputs, DraftPlan(0.5, 0, 1.0, (0.0,) * K), drafting))
    finally:
        del model.logits
    assert out.num_drafted.tolist() == [0, 3, 0, 0, 0]
    assert rows_seen == [1, 1, 1]  # row 1's three passes, nobody else's
    assert out.pass_ms[0] > 0  # row 1 drafts: the pending pass ran for every row
    assert_padding_past_num_drafted(out)
    plain(inputs)
    # next step: no draft accepted, one correction token back for every row
    follow = [dict(r, tokens=[6], start=len(r["tokens"]), reusable=0) for r in PLAN_ROWS]
    nxt, ref = stage(make_inputs(follow)), plain(make_inputs(follow))
    torch.testing.assert_close(nxt.draft_probs[:, 0], ref.draft_probs[:, 0])
    torch.testing.assert_close(nxt.draft_features[:, 0], ref.draft_features[:, 0])


def test_a_step_where_no_row_drafts_runs_nothing_and_its_inputs_run_with_the_next() -> None:
    """Every row drafting by a plan of D = 0 for three steps in a row: the draft runs no forward
    (pass_ms all 0), its cache stays empty, and the inputs wait (`SequenceSlots.defer`). The
    rows arrive in the first idle step, so their prompts wait too. The first step that drafts
    runs them in front of its own: its drafts, q and features are those of a stage given the
    whole history as a prompt (same seeds: no idle step drew a number)."""
    model = tiny_model(12)
    lazy = make_draft_stage(model)
    idle = DraftPlan(0.5, 0, 1.0, (0.0,) * K)
    calls: list[int] = []
    forward = model.forward_cached
    model.forward_cached = lambda *a, **k: calls.append(1) or forward(*a, **k)
    rows = [dict(r, start=0) for r in PLAN_ROWS]
    history = [list(r["tokens"]) for r in rows]
    try:
        for step in range(3):
            out = lazy(with_plan(make_inputs(rows), idle, [True] * len(rows)))
            assert out.num_drafted.tolist() == [0] * len(rows)
            assert out.pass_ms.abs().sum() == 0, step
            rows = [
                dict(r, tokens=[7 + step], start=r["start"] + len(r["tokens"]), reusable=0)
                for r in rows
            ]
            for h in history:
                h.append(7 + step)
        assert not calls
        ids = [r["seq_id"] for r in rows]
        assert [lazy.slots.held(s) for s in ids] == [r["start"] for r in rows]
        assert all(lazy.cache.length(s) == 0 for s in ids)
        out = lazy(make_inputs(rows))
    finally:
        del model.forward_cached
    assert len(calls) >= 1 and out.pass_ms[0] > 0
    whole = [dict(r, tokens=h) for r, h in zip(PLAN_ROWS, history, strict=True)]
    ref = make_draft_stage(model)(make_inputs(whole))
    assert torch.equal(out.draft_tokens, ref.draft_tokens)
    assert torch.equal(out.num_drafted, ref.num_drafted)
    torch.testing.assert_close(out.draft_probs, ref.draft_probs)
    torch.testing.assert_close(out.draft_features, ref.draft_features)
    fed = [len(h) + n - 1 for h, n in zip(history, CAPS, strict=True)]  # the last draft unfed
    assert [lazy.cache.length(s) for s in ids] == fed


def test_a_probe_of_some_rows_defers_the_others_inputs() -> None:
    """A plan of D = 0 whose probe takes the even seq ids (stride 2), three steps: rows 2 and 4
    draw x_0 each step and run their inputs; rows 1, 3 and 5 draw nothing, run nothing and hold
    their inputs. The first step without a plan runs them in front of their own: their drafts,
    q and features are those of a stage given the whole history as a prompt."""
    model = tiny_model(12)
    stage = make_draft_stage(model)
    probe = DraftPlan(0.0, 0, 1.0, (0.0,) * K, probe_stride=2)
    rows = [dict(r, start=0) for r in PLAN_ROWS]
    history = [list(r["tokens"]) for r in rows]
    ids = [r["seq_id"] for r in rows]
    for step in range(3):
        out = stage(with_plan(make_inputs(rows), probe, [True] * len(rows)))
        assert out.num_drafted.tolist() == [0, 1, 0, 1, 0]
        assert out.pass_ms[0] > 0 and out.draft_probs[[0, 2, 4]].abs().sum() == 0
        rows = [
            dict(r, tokens=[7 + step], start=r["start"] + len(r["tokens"]), reusable=0)
            for r in rows
        ]
        for h in history:
            h.append(7 + step)
    assert [stage.slots.held(s) for s in ids] == [r["start"] for r in rows]
    assert [stage.cache.length(s) for s in ids] == [0, rows[1]["start"], 0, rows[3]["start"], 0]
    out = stage(make_inputs(rows))
    whole = [dict(r, tokens=h) for r, h in zip(PLAN_ROWS, history, strict=True)]
    ref = make_draft_stage(model)(make_inputs(whole))
    unprobed = [0, 2, 4]  # their generators drew nothing before: the same draws as ref's
    assert torch.equal(out.draft_tokens[unprobed], ref.draft_tokens[unprobed])
    torch.testing.assert_close(out.draft_probs[unprobed], ref.draft_probs[unprobed])
    torch.testing.assert_close(out.draft_features[unprobed], ref.draft_features[unprobed])
    fed = [len(h) + n - 1 for h, n in zip(history, CAPS, strict=True)]  # the last draft unfed
    assert [stage.cache.length(s) for s in ids] == fed


def test_deferred_inputs_leave_with_a_release_and_a_restart() -> None:
    """A released sequence drops its deferred inputs; one that starts again at position 0
    holds nothing from before."""
    model = tiny_model(12)
    stage = make_draft_stage(model)
    idle = DraftPlan(0.5, 0, 1.0, (0.0,) * K)
    rows = [dict(r, start=0) for r in PLAN_ROWS[:2]]
    stage(with_plan(make_inputs(rows), idle, [True, True]))
    first, second = rows[0]["seq_id"], rows[1]["seq_id"]
    assert stage.slots.held(first) == len(rows[0]["tokens"])
    stage.slots.release([first])
    assert stage.slots.take_deferred(first) is None
    out = stage(make_inputs([rows[1]]))  # `second` starts over: its old prompt runs once
    drafted = int(out.num_drafted[0])
    assert drafted == 3 and stage.cache.length(second) == len(rows[1]["tokens"]) + drafted - 1


def test_rows_not_drafting_adaptively_ignore_the_plan() -> None:
    """Plan tau = 1, D = 1. Row 0 (adaptive, drafting by the plan) drafts one token; row 1
    (adaptive, adaptive_drafting False), row 2 (not adaptive, adaptive_drafting True) and row 3
    (neither) draft their caps, exactly as without a plan."""
    model = tiny_model(11)
    rows = [dict(r) for r in PLAN_ROWS[:4]]
    rows[2]["adaptive"] = rows[3]["adaptive"] = False
    inputs = make_inputs(rows)
    plain = make_draft_stage(model)(inputs)
    plan = DraftPlan(1.0, 1, 0.1, (-1.0,) * K)
    out = make_draft_stage(model)(with_plan(inputs, plan, [True, False, True, False]))
    assert out.num_drafted.tolist() == [1, 3, K, K]
    assert_same_drafts(out, plain, rows=slice(1, None))
    assert_same_drafts(out, plain, rows=slice(0, 1), positions=slice(0, 1))
    assert_padding_past_num_drafted(out)


def test_no_adaptive_drafting_tensor_means_fixed_drafting() -> None:
    """An empty adaptive_drafting (not sent) with a plan: every row drafts its cap."""
    model = tiny_model(11)
    inputs = make_inputs(PLAN_ROWS)
    plain = make_draft_stage(model)(inputs)
    plan = DraftPlan(1.0, 1, 0.1, (-1.0,) * K)
    out = make_draft_stage(model)(replace(inputs, draft_plan=plan.to_tensor()))
    assert out.num_drafted.tolist() == CAPS
    assert_same_drafts(out, plain)


@pytest.mark.parametrize("threshold", [0.2, 0.35, 0.6])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_num_drafted_is_the_drafted_prefix_and_follows_the_survival_rule(
    threshold: float, temperature: float
) -> None:
    """A row drafts x_0, then position i while s_{i-1} >= tau (s from the plan's coefficients and
    the features of what it drafted) and i < its limit; num_drafted counts exactly those."""
    model = tiny_model(10)
    rows = [r | {"temperature": temperature} for r in PLAN_ROWS]
    plan = DraftPlan(threshold, 3, 0.5, (-0.2, -0.1, 0.0, 0.1))
    out = make_draft_stage(model)(with_plan(make_inputs(rows), plan, [True] * len(rows)))
    assert_padding_past_num_drafted(out)
    conf = torch.sigmoid(0.5 * out.draft_features + torch.tensor(plan.intercepts))
    for r, cap in enumerate(CAPS):
        n, s, want = int(out.num_drafted[r]), 1.0, 1
        for i in range(min(cap, plan.depth) - 1):
            s *= float(conf[r, i])
            if s < threshold:
                break
            want += 1
        assert n == want, (r, n, want)


@pytest.mark.parametrize("threshold", [0.0, 0.2, 0.35, 1.0])
def test_compact_and_masked_modes_agree_at_temperature_zero(threshold: float) -> None:
    """Greedy rows, a plan that stops rows at different positions: the masked mode (stopped rows
    keep running, as on CUDA) drafts what the compact mode drafts, over two steps (the masked
    mode's extra cache entries past the drafts are dropped by the cache rule)."""
    model = tiny_model(10)
    rows = [r | {"temperature": 0.0} for r in PLAN_ROWS]
    plan = DraftPlan(threshold, K, 0.5, (-0.2,) * K)
    drafting = [True, True, True, True, False]
    compact, masked = (
        make_draft_stage(model),
        MaskedDraftStage(model, model.new_cache(8, 96, "cpu", torch.float64), K),
    )
    assert compact.compact and not masked.compact
    inputs = with_plan(make_inputs(rows), plan, drafting)
    for step in range(2):
        a, b = compact(inputs), masked(inputs)
        assert_same_drafts(a, b)
        assert torch.equal(a.num_drafted, b.num_drafted)
        assert_padding_past_num_drafted(a)
        assert b.pass_ms.shape == (K,)
        assert torch.equal(a.pass_ms > 0, torch.arange(K) < int(a.num_drafted.max()))
        if step == 0 and threshold == 0.35:
            assert len(set(a.num_drafted.tolist())) >= 3  # rows stopped at different positions
        # commit: accept up to one draft per row, then one new token
        nxt = []
        for r, row in enumerate(rows):
            accepted = min(1, int(a.num_drafted[r]))
            new = a.draft_tokens[r, :accepted].tolist() + [17 + r]
            start = row.get("start", 0) + len(row["tokens"])
            nxt.append(row | {"tokens": new, "start": start, "reusable": accepted})
        rows = nxt
        inputs = with_plan(make_inputs(rows), plan, drafting)


def test_pass_ms_marks_the_passes_run() -> None:
    """K entries (host float32): > 0 for each pass that ran, 0 for passes not run; an empty
    batch runs none."""
    model = tiny_model(10)
    stage = make_draft_stage(model)
    out = stage(make_inputs([{"seq_id": 1, "tokens": [1, 2], "n": 2}]))
    assert out.pass_ms.device == torch.device("cpu") and out.pass_ms.shape == (K,)
    assert (out.pass_ms > 0).tolist() == [True, True, False, False]
    empty = stage(make_inputs([], release=[1]))
    assert empty.pass_ms.shape == (K,) and empty.pass_ms.abs().sum() == 0
    assert empty.num_drafted.shape == (0,)


@pytest.mark.parametrize(
    ("plan", "match"),
    [
        (torch.zeros(4 + K - 1), "draft_plan has"),
        (torch.tensor([1.5, 1.0, 1.0, 0.0] + [0.0] * K), "threshold"),
        (torch.tensor([0.5, K + 1.0, 1.0, 0.0] + [0.0] * K), "depth"),
        (torch.tensor([0.5, 1.0, float("nan"), 0.0] + [0.0] * K), "finite"),
        (torch.tensor([0.5, 1.0, 1.0, -2.0] + [0.0] * K), "probe stride"),
    ],
)
def test_bad_plan_is_rejected(plan: torch.Tensor, match: str) -> None:
    stage = make_draft_stage(tiny_model(7, layers=1))
    inputs = make_inputs([{"seq_id": 1, "tokens": [1], "adaptive": True}])
    with pytest.raises(ValueError, match=match):
        stage(replace(inputs, draft_plan=plan, adaptive_drafting=torch.tensor([True])))
