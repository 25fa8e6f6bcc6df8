"""Scheduler tests against a fake step function that checks the step contract's bookkeeping.

Admission, the refit guard and the per-sequence bookkeeping are tested as units in
test_admission.py, test_refit_guard.py and test_sequence.py; here they are tested through the
scheduler (wiring, counters, free slots, releases, prev_num_accepted).
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest
import torch
from helpers.generation import generate
from helpers.stages import perturbed, tiny_model

import avspec.engine.scheduler
from avspec.av.estimator import refit_excluded
from avspec.contract import StepInputs, StepOutputs
from avspec.engine.admission import Overloaded
from avspec.engine.request_limits import MAX_TEMPERATURE
from avspec.engine.scheduler import RequestTimedOut, Scheduler
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import GenerationRequest, StepReport
from avspec.engine.step import SpeculativeStep, StepCapacity

K = 8
EOS = 256


def token_at(seq_id: int, position: int) -> int:
    """The fake model's token at absolute `position` of sequence `seq_id`."""
    return 1 + (7 * seq_id + 3 * position) % 50


class FakeStep:
    """Contract-checking stand-in: accepts half the drafts, emits token_at(...) tokens."""

    max_draft_tokens = K

    def __init__(self, eos_at: dict[int, int] | None = None, poison: set[int] | None = None):
        self.eos_at = eos_at or {}
        self.poison = poison or set()
        self.history: dict[int, list[int]] = {}
        self.calls: list[StepInputs] = []
        self.released: list[int] = []

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        self.calls.append(inputs)
        for seq_id in inputs.release_seq_ids.tolist():
            self.history.pop(seq_id, None)
            self.released.append(seq_id)
        seq_ids = inputs.seq_ids.tolist()
        if self.poison & set(seq_ids):
            raise RuntimeError("poisoned sequence")
        batch = len(seq_ids)
        output_ids = torch.full((batch, K + 1), -1, dtype=torch.int32)
        num_accepted = torch.zeros(batch, dtype=torch.int32)
        for r, seq_id in enumerate(seq_ids):
            start = int(inputs.start_positions[r])
            if start == 0:
                self.history[seq_id] = []
            history = self.history[seq_id]
            assert start == len(history), "start_positions must equal the committed length"
            history.extend(inputs.input_ids[r, : int(inputs.input_lengths[r])].tolist())
            accepted = int(inputs.num_draft_tokens[r]) // 2
            for j in range(accepted + 1):
                position = len(history) + j
                eos = self.eos_at.get(seq_id) == position
                output_ids[r, j] = EOS if eos else token_at(seq_id, position)
            num_accepted[r] = accepted
        return StepOutputs(output_ids, num_accepted, inputs.num_draft_tokens.clone())


def expected(seq_id: int, prompt_len: int, max_tokens: int) -> list[int]:
    return [token_at(seq_id, prompt_len + i) for i in range(max_tokens)]


class Collector:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.reports: list[StepReport] = []
        self.errors: list[Exception] = []

    def on_step(self, report: StepReport) -> None:
        self.reports.append(report)
        self.tokens.extend(report.new_tokens)

    def on_error(self, exc: Exception) -> None:
        self.errors.append(exc)


def make(fake: FakeStep, max_batch_size: int = 8, max_context: int = 128) -> Scheduler:
    return Scheduler(fake, EOS, max_batch_size, max_context, K)


def submit(scheduler: Scheduler, prompt_len: int, max_tokens: int, **kw) -> tuple[int, Collector]:
    c = Collector()
    seq_id = scheduler.submit(
        GenerationRequest([5] * prompt_len, max_tokens, **kw), c.on_step, c.on_error
    )
    return seq_id, c


def test_max_tokens_honoured_exactly_and_caches_released() -> None:
    fake = FakeStep()
    scheduler = make(fake)
    runs = [
        submit(scheduler, n, m, num_draft_tokens=d) for n, m, d in [(3, 1, 4), (5, 7, 4), (1, 9, 0)]
    ]
    scheduler.run_until_idle()
    for (seq_id, c), (n, m) in zip(runs, [(3, 1), (5, 7), (1, 9)], strict=True):
        assert c.tokens == expected(seq_id, n, m)
        assert c.reports[-1].finished and c.reports[-1].finish_reason == "length"
        assert not c.errors
    assert fake.history == {}, "every finished sequence is released (empty-batch step)"
    assert scheduler.counters.tokens_generated == 17
    assert scheduler.counters.requests_finished == 3
    # Drafting never overshoots: num_draft_tokens <= tokens still wanted - 1.
    assert fake.calls[0].num_draft_tokens.tolist() == [0, 4, 0]


def test_eos_finishes_the_request_and_releases_it() -> None:
    """The scheduler's eos_id reaches the commit (its token rules: test_sequence.py)."""
    fake = FakeStep(eos_at={1: 6})
    scheduler = make(fake)
    seq_id, c = submit(scheduler, 4, 20)
    scheduler.run_until_idle()
    assert c.tokens == expected(seq_id, 4, 2)
    assert c.reports[-1].finish_reason == "stop"
    assert fake.released == [seq_id] and scheduler.counters.requests_finished == 1


def test_eos_ids_set_stops_on_any() -> None:
    """A set of EOS ids: the scheduler stops on any one of them; an int still works."""
    assert make(FakeStep()).eos_ids == frozenset({EOS})
    fake = FakeStep()
    seq_ids = [1, 2]
    # stop sequence 1 on its own 3rd generated token, sequence 2 on plain EOS
    stop_token = token_at(seq_ids[0], 4 + 2)
    fake.eos_at = {seq_ids[1]: 5 + 1}
    scheduler = Scheduler(fake, {EOS, stop_token}, 8, 128, K)
    (a, ca), (b, cb) = submit(scheduler, 4, 20), submit(scheduler, 5, 20)
    assert [a, b] == seq_ids
    scheduler.run_until_idle()
    assert ca.tokens == expected(a, 4, 2) and ca.reports[-1].finish_reason == "stop"
    assert cb.tokens == expected(b, 5, 1) and cb.reports[-1].finish_reason == "stop"


def test_queue_beyond_max_batch_size_joins_later() -> None:
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=2)
    runs = [submit(scheduler, 2 + i, 3 + 2 * i) for i in range(4)]
    assert scheduler.step() == 2
    assert scheduler.live_count == 2 and scheduler.queued_count == 2
    scheduler.run_until_idle()
    assert max(c.batch_size for c in fake.calls) == 2
    for i, (seq_id, c) in enumerate(runs):
        assert c.tokens == expected(seq_id, 2 + i, 3 + 2 * i)


def test_prev_num_accepted_aligned_with_previous_batch() -> None:
    fake = FakeStep()
    scheduler = make(fake)
    submit(scheduler, 2, 30, num_draft_tokens=4)
    submit(scheduler, 2, 30, num_draft_tokens=2)
    scheduler.step()
    scheduler.step()
    assert fake.calls[0].prev_num_accepted.numel() == 0
    assert fake.calls[1].prev_num_accepted.tolist() == [2, 1]


def test_cancel_releases_the_sequence() -> None:
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=2)
    keep_id, keep = submit(scheduler, 3, 40)
    gone_id, gone = submit(scheduler, 3, 40)
    queued_id, queued = submit(scheduler, 3, 40)
    scheduler.step()
    assert gone_id in fake.history
    assert scheduler.cancel(gone_id)
    assert scheduler.cancel(queued_id)
    assert not scheduler.cancel(gone_id) and not scheduler.cancel(999)
    assert gone.reports[-1].finish_reason == "cancelled"
    assert queued.reports == [StepReport([], 0, 0, 0, True, "cancelled")]
    scheduler.step()
    assert fake.calls[-1].release_seq_ids.tolist() == [gone_id]
    assert gone_id not in fake.history and queued_id not in fake.history
    scheduler.run_until_idle()
    assert keep.tokens == expected(keep_id, 3, 40)
    assert scheduler.counters.requests_cancelled == 2


def test_poisoned_sequence_fails_alone() -> None:
    fake = FakeStep(poison={2})
    scheduler = make(fake)
    runs = [submit(scheduler, 3, 6) for _ in range(3)]
    scheduler.run_until_idle()
    (id1, c1), (_, bad), (id3, c3) = runs
    assert c1.tokens == expected(id1, 3, 6) and c3.tokens == expected(id3, 3, 6)
    assert len(bad.errors) == 1 and "poisoned" in str(bad.errors[0])
    assert not c1.errors and not c3.errors
    replays = [c for c in fake.calls if c.batch_size == 1]
    assert replays and all(c.prev_num_accepted.numel() == 0 for c in replays)
    assert 2 in fake.released
    assert scheduler.counters.requests_failed == 1
    assert scheduler.counters.step_failures == 1


def test_malformed_outputs_fail_the_request() -> None:
    def bad_step(inputs: StepInputs) -> StepOutputs:
        batch = inputs.batch_size
        zeros = torch.zeros(batch, dtype=torch.int32)
        return StepOutputs(torch.zeros(batch, K), zeros, zeros)  # K columns, not K + 1

    scheduler = Scheduler(bad_step, EOS, 4, 64, K)
    _, c = submit(scheduler, 2, 3)
    scheduler.run_until_idle()
    assert len(c.errors) == 1 and "output_ids" in str(c.errors[0])


def test_raising_callback_does_not_kill_the_loop() -> None:
    fake = FakeStep()
    scheduler = make(fake)
    good_id, good = submit(scheduler, 2, 9)

    def explode(report: StepReport) -> None:
        raise RuntimeError("client went away")

    errors: list[Exception] = []

    def explode_too(exc: Exception) -> None:
        errors.append(exc)
        raise RuntimeError("and the error handler too")

    scheduler.submit(GenerationRequest([5, 5], 9), explode, explode_too)
    scheduler.run_until_idle()
    assert good.tokens == expected(good_id, 2, 9)
    assert len(errors) == 1 and "client went away" in str(errors[0])
    assert scheduler.counters.callback_errors == 2
    assert fake.history == {}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_ids": []}, "prompt_ids"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"num_draft_tokens": K + 1}, "num_draft_tokens"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 1.01}, "temperature"),
        ({"client": None}, "client"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 60}, "max_context"),
    ],
)
def test_submission_validation(kwargs: dict, match: str) -> None:
    scheduler = make(FakeStep(), max_context=64)
    fields = {"prompt_ids": [1, 2, 3], "max_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        scheduler.submit(GenerationRequest(**fields), print, print)
    assert scheduler.queued_count == 0


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, 64, K), {}, "max_batch_size"),
        ((4, 64, -1), {}, "max_draft_tokens"),
        ((4, 5, K), {}, "max_context"),
        ((4, 64, K), {"max_queued": 0}, "max_queued"),
        ((4, 64, K), {"max_queued_per_client": 0}, "max_queued_per_client"),
        ((4, 64, K), {"refit_max_temperature": float("nan")}, "refit_max_temperature"),
        ((4, 64, K), {"refit_client_share": 0.0}, "refit_client_share"),
        ((4, 64, K), {"refit_client_share": 1.5}, "refit_client_share"),
    ],
)
def test_constructor_validation(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scheduler(FakeStep(), EOS, *args, limits=SchedulerLimits(**kwargs))


def test_background_thread_serves_and_stops() -> None:
    fake = FakeStep()
    scheduler = make(fake)
    scheduler.start()
    scheduler.start()  # idempotent
    try:
        done = threading.Event()
        c = Collector()

        def on_step(report: StepReport) -> None:
            c.on_step(report)
            if report.finished:
                done.set()

        seq_id = scheduler.submit(GenerationRequest([5, 5, 5], 11), on_step, c.on_error)
        assert done.wait(10)
        assert c.tokens == expected(seq_id, 3, 11)
    finally:
        scheduler.stop(timeout_s=10)
    assert scheduler._thread is not None and not scheduler._thread.is_alive()


def test_background_thread_survives_a_scheduler_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    scheduler = make(FakeStep())
    failed = threading.Event()
    monkeypatch.setattr(scheduler, "_apply", lambda *a: 1 / 0)
    scheduler.start()
    try:
        scheduler.submit(GenerationRequest([5], 3), print, lambda exc: failed.set())
        assert failed.wait(10)
    finally:
        scheduler.stop(timeout_s=10)
    assert scheduler.live_count == 0


def test_generate_helper() -> None:
    fake = FakeStep()
    out = generate(fake, [GenerationRequest([5] * 3, 4), GenerationRequest([5], 2)])
    assert out == [expected(1, 3, 4), expected(2, 1, 2)]
    with pytest.raises(RuntimeError, match="failed"):
        generate(FakeStep(poison={1}), [GenerationRequest([5], 2)])
    scheduler = make(FakeStep())
    assert generate(scheduler, [GenerationRequest([5], 1)]) == [expected(1, 1, 1)]


class FailOn:
    """Wraps a FakeStep: raises on the given call numbers (1-based) before the fake sees them."""

    def __init__(self, fake: FakeStep, calls: set[int]) -> None:
        self.fake, self.fail, self.calls = fake, calls, 0
        self.max_draft_tokens = fake.max_draft_tokens

    def __call__(self, inputs: StepInputs) -> StepOutputs:
        self.calls += 1
        if self.calls in self.fail:
            raise RuntimeError(f"transient failure of call {self.calls}")
        return self.fake(inputs)


def test_failed_release_only_step_keeps_its_releases() -> None:
    fake = FakeStep()
    scheduler = Scheduler(FailOn(fake, {2}), EOS, 8, 128, K)
    done_id, _ = submit(scheduler, 3, 1)
    scheduler.step()  # call 1: finishes the request
    scheduler.step()  # call 2: release-only, fails
    assert fake.released == []
    scheduler.step()  # call 3 carries the release again
    assert fake.released == [done_id] and fake.history == {}


def test_failed_replay_hands_its_releases_on() -> None:
    fake = FakeStep()
    scheduler = Scheduler(FailOn(fake, {2, 3}), EOS, 8, 128, K)
    done_id, _ = submit(scheduler, 3, 1)
    scheduler.step()  # call 1: finishes the first request; its release is pending
    (bad_id, bad), (good_id, good) = submit(scheduler, 3, 6), submit(scheduler, 3, 6)
    scheduler.run_until_idle()  # call 2 (batch) and call 3 (first replay) fail
    assert done_id in fake.released and bad_id in fake.released
    assert fake.history == {}
    assert len(bad.errors) == 1 and good.tokens == expected(good_id, 3, 6)


def test_a_burst_cannot_starve_another_client() -> None:
    """640 queued from A, then one from B: B joins the first batch, before A's 64th."""
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=64)
    a_ids = [submit(scheduler, 2, 3, client="A")[0] for _ in range(640)]
    b_id, b = submit(scheduler, 2, 3, client="B")
    assert scheduler.queued_by_client() == {"A": 640, "B": 1}
    scheduler.step()
    stepped = fake.calls[0].seq_ids.tolist()
    assert stepped == [a_ids[0], b_id, *a_ids[1:63]]  # admission order: A, B, then A's
    assert scheduler.queued_by_client() == {"A": 577}
    assert b.reports and not b.errors


def test_queue_limits_raise_overloaded() -> None:
    scheduler = Scheduler(
        FakeStep(), EOS, 2, 128, K, limits=SchedulerLimits(max_queued=3, max_queued_per_client=2)
    )
    # Two free batch slots count as room: each limit applies to requests beyond them.
    for _ in range(4):
        submit(scheduler, 2, 3, client="A")
    with pytest.raises(Overloaded, match=r"overloaded: 2 requests queued for this client "
                       r"\(limit 2\); retry later"):  # fmt: skip
        submit(scheduler, 2, 3, client="A")
    submit(scheduler, 2, 3, client="B")
    with pytest.raises(Overloaded, match=r"overloaded: 3 requests queued \(limit 3\); retry"):
        submit(scheduler, 2, 3, client="C")
    assert scheduler.queued_by_client() == {"A": 4, "B": 1}
    counters = scheduler.counters
    assert (counters.requests_submitted, counters.requests_rejected) == (5, 2)
    scheduler.step()  # two join the batch: no free slot left, three wait
    assert scheduler.queued_count == 3
    with pytest.raises(Overloaded, match="3 requests queued"):
        submit(scheduler, 2, 3, client="D")
    scheduler.run_until_idle()
    submit(scheduler, 2, 3, client="D")  # room again


def test_cancel_a_queued_request_of_the_rotation() -> None:
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=1)
    first, _ = submit(scheduler, 2, 2, client="A")
    second, cancelled = submit(scheduler, 2, 2, client="A")
    only_b, _ = submit(scheduler, 2, 2, client="B")
    assert scheduler.cancel(second) and scheduler.cancel(only_b)
    assert scheduler.queued_by_client() == {"A": 1}
    assert cancelled.reports == [StepReport([], 0, 0, 0, True, "cancelled")]
    scheduler.run_until_idle()
    stepped = {i for c in fake.calls for i in c.seq_ids.tolist()}
    assert stepped == {first} and scheduler.queued_count == 0


def outcomes_sent(fake: FakeStep, call: int) -> list[int]:
    """prev_num_accepted of call `call`: the refit labels of the step before it."""
    return fake.calls[call].prev_num_accepted.tolist()


def test_hot_rows_do_not_feed_the_refit() -> None:
    fake = FakeStep()
    scheduler = Scheduler(fake, EOS, 8, 128, K, limits=SchedulerLimits(refit_max_temperature=2.0))
    submit(scheduler, 2, 30, temperature=0.7)
    submit(scheduler, 2, 30, temperature=2.5)
    submit(scheduler, 2, 30, temperature=2.0)
    scheduler.step()
    scheduler.step()
    assert outcomes_sent(fake, 1) == [K // 2, refit_excluded(torch.tensor(K // 2)), K // 2]


def test_run_until_idle_returns_while_releases_cannot_be_sent() -> None:
    fake = FakeStep()
    down = FailOn(fake, set(range(2, 100)))
    scheduler = Scheduler(down, EOS, 8, 128, K)
    done_id, done = submit(scheduler, 3, 1)
    scheduler.run_until_idle()  # the release-only call fails: it returns, release pending
    assert done.tokens and fake.released == []
    down.fail = set()
    scheduler.run_until_idle()
    assert fake.released == [done_id]


def test_background_thread_resends_releases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(avspec.engine.scheduler, "_RETRY_S", 0.01)
    fake = FakeStep()
    scheduler = Scheduler(FailOn(fake, {2, 3}), EOS, 8, 128, K)
    done_id, _ = submit(scheduler, 3, 1)
    scheduler.start()
    try:
        deadline = time.monotonic() + 10
        while not fake.released and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        scheduler.stop(timeout_s=10)
    assert fake.released == [done_id] and scheduler.counters.steps >= 4


def test_in_process_step_takes_the_refit_guard() -> None:
    """Through SpeculativeStep (check_values on): -1 rows are accepted and never labelled."""
    target = tiny_model(20, layers=1, width=16)
    draft = perturbed(target, 0.3, seed=5)
    k = 4
    prompts = [[72, 101, 108], [1] * 5, [200, 3, 17], [42]]
    labels, outputs = [], []
    for share in (1.0, 0.25):
        step = SpeculativeStep.from_models(target, draft, StepCapacity(k, 8, 96))
        scheduler = Scheduler(step, EOS, 8, 96, k, limits=SchedulerLimits(refit_client_share=share))
        requests = [GenerationRequest(p, 10, temperature=0.0, num_draft_tokens=k) for p in prompts]
        with torch.no_grad():
            outputs.append(generate(scheduler, requests))
        labels.append(float(step.verifier.estimator.stats.n.sum()))
        assert step.verifier.num_dropped_records == 0
    assert outputs[0] == outputs[1]  # greedy: the refit never changes the text
    assert 0 < labels[1] < labels[0]


# --- fair share of the batch: pausing a client over its quota --------------------------------


def stepped_ids(fake: FakeStep, call: int = -1) -> list[int]:
    return fake.calls[call].seq_ids.tolist()


def test_another_client_is_admitted_while_one_holds_every_slot() -> None:
    """A holds all 8 slots with long streams; B's short request joins at the next step and
    finishes while A's streams still run; A's paused streams continue exactly (the fake checks
    every start position against what it holds) and are not released while paused."""
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=8)
    hog = [submit(scheduler, 2, 60, client="A") for _ in range(8)]
    for _ in range(3):
        scheduler.step()
    b_id, b = submit(scheduler, 2, 9, client="B")
    scheduler.step()
    assert b_id in stepped_ids(fake)  # admitted at the very next step boundary
    assert scheduler.counters.preemptions == 1 and scheduler.paused_count == 1
    paused = hog[-1][0]  # A's latest request gives way
    assert paused not in stepped_ids(fake) and paused not in fake.released
    while not b.reports[-1].finished:
        scheduler.step()
    assert b.tokens == expected(b_id, 2, 9)
    assert all(not c.reports[-1].finished for _, c in hog)  # A's streams still run
    scheduler.run_until_idle()
    for seq_id, c in hog:
        assert c.tokens == expected(seq_id, 2, 60) and not c.errors
    assert fake.history == {} and scheduler.paused_count == 0


def test_no_client_holds_more_than_its_share_while_another_waits() -> None:
    """Three clients, 9 slots: each gets 3 at the first boundary where all three wait, whatever
    they held before; a client asking for less than its share leaves the rest to the others."""
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=9)
    for _ in range(9):
        submit(scheduler, 2, 60, client="A")
    scheduler.step()
    for _ in range(5):
        submit(scheduler, 2, 60, client="B")
    submit(scheduler, 2, 60, client="C")
    scheduler.step()
    by_client = Counter(
        scheduler._find(seq_id).request.client for seq_id in stepped_ids(fake)
    )  # every stepped id is live or paused, so _find knows it
    assert by_client == {"A": 4, "B": 4, "C": 1}  # C wants one: A and B split the other 8
    submit(scheduler, 2, 60, client="C")
    submit(scheduler, 2, 60, client="C")
    scheduler.step()
    by_client = Counter(scheduler._find(i).request.client for i in stepped_ids(fake))
    assert by_client == {"A": 3, "B": 3, "C": 3}
    assert scheduler.counters.preemptions == 5 + 2


def test_paused_sequences_resume_first_and_lowest_id_first() -> None:
    fake = FakeStep()
    scheduler = make(fake, max_batch_size=4)
    a_ids = [submit(scheduler, 2, 40, client="A")[0] for _ in range(6)]
    scheduler.step()
    assert stepped_ids(fake) == a_ids[:4]
    submit(scheduler, 2, 1, client="B")
    submit(scheduler, 2, 1, client="B")
    scheduler.step()  # B's two requests take two of A's slots: A's two latest pause
    assert sorted(stepped_ids(fake))[:2] == a_ids[:2]
    assert scheduler.queued_by_client() == {"A": 4}
    scheduler.step()  # B's one-token requests finished: A's paused ones come back first
    assert sorted(stepped_ids(fake)) == a_ids[:4]


def test_cancel_and_timeout_release_a_paused_sequence() -> None:
    fake = FakeStep()
    now = [0.0]
    scheduler = Scheduler(
        fake, EOS, 2, 128, K, limits=SchedulerLimits(request_timeout_s=10.0), clock=lambda: now[0]
    )
    (a1, _), (a2, ca2) = submit(scheduler, 2, 60, client="A"), submit(scheduler, 2, 60, client="A")
    scheduler.step()
    now[0] = 5.0
    b_id, b = submit(scheduler, 2, 60, client="B")
    scheduler.step()
    assert scheduler.paused_count == 1 and a2 not in stepped_ids(fake)
    assert scheduler.cancel(a2)
    assert ca2.reports[-1].finish_reason == "cancelled"
    scheduler.step()
    assert a2 in fake.calls[-1].release_seq_ids.tolist() and a2 not in fake.history
    now[0] = 10.0  # A's first request reaches its limit; B's has 5 s left
    scheduler.step()
    assert a1 in fake.calls[-1].release_seq_ids.tolist()  # released with the same step
    assert stepped_ids(fake) == [b_id] and not b.errors
    assert scheduler.counters.requests_timed_out == 1


def test_request_timeout_ends_queued_and_live_requests_naming_the_limit() -> None:
    fake = FakeStep()
    now = [100.0]
    scheduler = Scheduler(
        fake, EOS, 1, 128, K, limits=SchedulerLimits(request_timeout_s=2.5), clock=lambda: now[0]
    )
    live_id, live = submit(scheduler, 2, 60)
    scheduler.step()
    _, queued = submit(scheduler, 2, 60)
    scheduler.step()
    now[0] = 102.5
    scheduler.step()
    for c in (live, queued):
        assert len(c.errors) == 1 and isinstance(c.errors[0], RequestTimedOut)
        assert "limit of 2.5 s per request (request_timeout_s)" in str(c.errors[0])
    assert "after 10 of 60 tokens" in str(live.errors[0])  # two steps of K // 2 + 1 tokens
    assert "after 0 of 60 tokens" in str(queued.errors[0])
    assert fake.released == [live_id] and fake.history == {}
    assert scheduler.live_count == scheduler.queued_count == 0
    assert scheduler.counters.requests_timed_out == 2 and scheduler.counters.requests_failed == 0


def test_max_resident_bounds_live_plus_paused() -> None:
    """Paused sequences keep their stage slots: a request that has not started is admitted only
    while live + paused stay within max_resident; a paused one can always resume."""
    fake = FakeStep()
    scheduler = Scheduler(fake, EOS, 4, 128, K, limits=SchedulerLimits(max_resident=5))
    for _ in range(4):
        submit(scheduler, 2, 40, client="A")
    scheduler.step()
    b = [submit(scheduler, 2, 40, client="B")[0] for _ in range(2)]
    scheduler.step()  # room for one more resident sequence: B gets one slot, A pauses one
    assert scheduler.live_count == 4 and scheduler.paused_count == 1
    assert b[0] in stepped_ids(fake) and b[1] not in stepped_ids(fake)
    for _ in range(3):
        scheduler.step()
        assert scheduler.live_count + scheduler.paused_count <= 5
        assert b[1] not in stepped_ids(fake)
    scheduler.run_until_idle()
    assert fake.history == {}


def test_a_shared_kv_pool_admits_what_fits_together() -> None:
    """kv_pool_tokens: prompt + max_tokens + K of every admitted request fit the pool together;
    the next waits until one ends; a request that could never fit is refused by name."""
    fake = FakeStep()
    need = 10 + 30 + K
    scheduler = Scheduler(
        fake, EOS, 4, 128, K, limits=SchedulerLimits(kv_pool_tokens=2 * need + need // 2)
    )
    ids = [submit(scheduler, 10, 30)[0] for _ in range(3)]
    scheduler.step()
    assert scheduler.live_count == 2 and ids[2] not in stepped_ids(fake)
    while ids[2] not in stepped_ids(fake):
        assert scheduler.live_count <= 2
        scheduler.step()
    scheduler.run_until_idle()
    assert fake.history == {}
    with pytest.raises(ValueError, match=r"exceeds the KV pool's cells \(kv_pool_tokens\) 120"):
        submit(scheduler, 80, 40)
    with pytest.raises(ValueError, match="kv_pool_tokens must be >= "):
        Scheduler(fake, EOS, 4, 128, K, limits=SchedulerLimits(kv_pool_tokens=K))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_resident": 3}, "max_resident must be >= max_batch_size 4"),
        ({"request_timeout_s": 0.0}, "request_timeout_s must be > 0"),
        ({"request_timeout_s": float("nan")}, "request_timeout_s must be > 0"),
    ],
)
def test_fair_share_constructor_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Scheduler(FakeStep(), EOS, 4, 64, K, limits=SchedulerLimits(**kwargs))


def test_a_large_request_is_not_overtaken_in_the_pool() -> None:
    """A request waiting for cells is admitted before any later one: small requests of other
    clients arriving after it wait too, so it starts once the running ones end (without this
    rule, a stream of small requests that each fit keeps it out while they keep coming)."""

    def ever_stepped(fake: FakeStep) -> set[int]:
        return {i for call in fake.calls for i in call.seq_ids.tolist()}

    fake = FakeStep()
    pool = 120
    scheduler = Scheduler(fake, EOS, 8, 128, K, limits=SchedulerLimits(kv_pool_tokens=pool))
    running = submit(scheduler, 10, 50, client="A")[0]  # 60 + K cells
    scheduler.step()
    large = submit(scheduler, 10, 90, client="B")[0]  # 100 + K: not while `running` runs
    # other clients' (within one client the queue is first in, first out anyway)
    small = [submit(scheduler, 4, 4, client=f"C{i}")[0] for i in range(3)]  # 8 + K: fit now
    scheduler.step()
    assert large not in ever_stepped(fake) and not set(small) & ever_stepped(fake)
    while large not in ever_stepped(fake):
        assert not set(small) & ever_stepped(fake), "a later request overtook the large one"
        scheduler.step()
    scheduler.run_until_idle()
    assert running in ever_stepped(fake) and set(small) <= ever_stepped(fake)
    assert fake.history == {}
