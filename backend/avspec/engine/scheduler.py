"""In-flight batching: admit requests, run one speculative step for all live sequences, stream.

Pure Python around a `step_fn(StepInputs) -> StepOutputs` (the in-process `SpeculativeStep` or
the Triton step ensemble).

- Per-sequence bookkeeping (avspec.engine.sequence, which states the contract's `input_ids`,
  `reusable` and `start_positions`, the EOS and `max_tokens` rules and the draft cap): each
  step builds its inputs from the live sequences' states and commits each outcome to its own.
- Admission (avspec.engine.admission, which states the limits and the fairness bound): `submit`
  checks a request (avspec.engine.request_limits: ValueError), then queues it per client or
  raises `Overloaded` (nothing enqueued, `requests_rejected` counted); at each step boundary
  queued requests fill the free batch slots, one per client in turn.
- Fair share of the batch and the KV pool (avspec.engine.rebalance): at each step boundary a
  client over its max-min fair quota has its excess paused while another waits (a paused
  sequence keeps its stage state and KV cache and resumes where it stopped: its output is what
  it would have been unpaused whenever that output does not depend on the batch), and the free
  slots are filled within `max_resident` and the pool's cells. The stages' idle sweep frees a
  sequence not stepped for their `idle_timeout_s`: keep `request_timeout_s` below it so a
  paused request ends with the timeout error before its state could be swept (a swept one fails
  with an error, it never hangs).
- Wall-clock limit (`request_timeout_s`): at each step boundary a request queued, live or paused
  for longer than the limit since `submit` is ended with `RequestTimedOut` through `on_error`
  (released like a cancelled one).
- Error isolation (avspec.engine.step_call): if `step_fn` raises, the step is replayed for each
  sequence alone; a sequence that still fails alone gets `on_error` and is released; the others
  continue. A callback that raises fails only its own request (its stream is broken).
- Finished, cancelled and failed sequences go out in the next step's `release_seq_ids`; with no
  live sequence left, an empty-batch step carries them. Releases are never lost: a call that
  raised hands its releases to the next call (a release is idempotent on the stages).
- Stale state (avspec.engine.sequence.Carry): what step t returned that step t + 1 needs, the
  outcomes for the refit, the verifier's drafting plan and the measured stage times, goes out
  with the next step and nowhere else, so no stage ever reads state of its own step.
- Refit guard (avspec.engine.refit_guard, which states the per-client share bound): the
  `prev_num_accepted` sent with the next step marks, with `avspec.av.estimator.refit_excluded`,
  the rows whose outcome does not feed the refit (too hot, or over their client's share).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from avspec.engine.admission import AdmissionQueue, Overloaded
from avspec.engine.rebalance import rebalance
from avspec.engine.refit_guard import RefitGuard
from avspec.engine.request_limits import MAX_TEMPERATURE as MAX_TEMPERATURE  # serving's import
from avspec.engine.request_limits import positions_needed, validate_request
from avspec.engine.scheduler_limits import UNLIMITED, SchedulerLimits
from avspec.engine.sequence import (
    Carry,
    GenerationRequest,
    Outcome,
    SequenceState,
    StepReport,
    as_eos_ids,
)
from avspec.engine.step_call import StepFn, call_step

logger = logging.getLogger(__name__)

_RETRY_S = 0.5  # background loop: wait after a release-only step failed before resending


@dataclass
class SchedulerCounters:
    """Running totals since the scheduler was built."""

    steps: int = 0
    step_failures: int = 0
    requests_submitted: int = 0
    requests_rejected: int = 0  # Overloaded at submission
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_timed_out: int = 0  # ended by request_timeout_s (not counted as failed)
    preemptions: int = 0  # sequences paused to give their slot to a client under its share
    callback_errors: int = 0
    tokens_generated: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0


class RequestTimedOut(RuntimeError):
    """A request ran past the per-request wall-clock limit; the message names the limit."""


@dataclass
class _Events:
    """Callbacks to run after the lock is dropped."""

    reports: list[tuple[SequenceState, StepReport]] = field(default_factory=list)
    errors: list[tuple[SequenceState, Exception]] = field(default_factory=list)


class Scheduler:
    """Thread-safe in-flight batching scheduler over a step function.

    `limits` (avspec.engine.scheduler_limits.SchedulerLimits): the admission limits, the
    resident bound, the wall-clock limit, the shared KV pool, the prefill chunk and the refit
    guard, all off by default; the served entry model sets them from its parameters
    (docs/serving.md). The fair share of the batch is always on. `clock` (seconds, monotonic)
    times the wall-clock limit.
    """

    def __init__(
        self,
        step_fn: StepFn,
        eos_ids: Collection[int] | int,
        max_batch_size: int,
        max_context: int,
        max_draft_tokens: int,
        *,
        limits: SchedulerLimits = UNLIMITED,
        first_seq_id: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        max_resident, request_timeout_s = limits.max_resident, limits.request_timeout_s
        kv_pool_tokens, prefill_chunk = limits.kv_pool_tokens, limits.prefill_chunk
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        if max_context < 2 + max_draft_tokens:
            raise ValueError(f"max_context {max_context} leaves no room for a prompt and a token")
        if not 1 <= first_seq_id < 1 << 62:
            raise ValueError(f"first_seq_id must lie in 1..2^62-1, got {first_seq_id}")
        if max_resident is not None and max_resident < max_batch_size:
            raise ValueError(
                f"max_resident must be >= max_batch_size {max_batch_size} or None, "
                f"got {max_resident}"
            )
        if request_timeout_s is not None and not request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0 or None, got {request_timeout_s}")
        if kv_pool_tokens is not None and kv_pool_tokens < 2 + max_draft_tokens:
            raise ValueError(f"kv_pool_tokens must be >= {2 + max_draft_tokens} or None, "
                             f"got {kv_pool_tokens}")  # fmt: skip
        if prefill_chunk and prefill_chunk < 2 + max_draft_tokens:
            raise ValueError(f"prefill_chunk must be 0 or >= {2 + max_draft_tokens} (more than "
                             f"a step's accepted tokens), got {prefill_chunk}")  # fmt: skip
        self.step_fn = step_fn
        self.limits = limits
        self.eos_ids = as_eos_ids(eos_ids)
        self.prefill_chunk = prefill_chunk
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.max_draft_tokens = max_draft_tokens
        self.max_resident = max_resident
        self.request_timeout_s = request_timeout_s
        self.kv_pool_tokens = kv_pool_tokens
        self.clock = clock
        self.counters = SchedulerCounters()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._queue: AdmissionQueue[SequenceState] = AdmissionQueue(
            limits.max_queued, limits.max_queued_per_client
        )
        self._guard = RefitGuard(limits.refit_max_temperature, limits.refit_client_share)
        self._live: list[SequenceState] = []
        self._releases: list[int] = []
        self._carry = Carry()  # stale state for the next step (avspec.engine.sequence.Carry)
        self._stalled = False  # the last step was release-only and its call failed
        self._next_id = first_seq_id
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def live_count(self) -> int:
        """Sequences admitted to the batch (not counting the queue)."""
        with self._lock:
            return len(self._live)

    @property
    def queued_count(self) -> int:
        """Requests waiting for a batch slot, all clients together."""
        with self._lock:
            return len(self._queue)

    @property
    def paused_count(self) -> int:
        """Queued sequences that ran before and were paused by the fair share (state kept)."""
        with self._lock:
            return sum(seq.stepped for seq in self._queue)

    def queued_by_client(self) -> dict[str, int]:
        """Waiting requests per client, paused ones included (clients with none are absent)."""
        with self._lock:
            return self._queue.by_client()

    def submit(
        self,
        request: GenerationRequest,
        on_step: Callable[[StepReport], None],
        on_error: Callable[[Exception], None],
    ) -> int:
        """Validate and enqueue `request`; return its sequence id.

        Raises ValueError if invalid, Overloaded if a queue limit is reached.
        """
        validate_request(request, self.max_draft_tokens, self.max_context, self.kv_pool_tokens)
        with self._lock:
            seq = SequenceState(self._next_id, request, on_step, on_error, list(request.prompt_ids),
                                prefill_chunk=self.prefill_chunk)  # fmt: skip
            if self.request_timeout_s is not None:
                seq.deadline = self.clock() + self.request_timeout_s
            try:
                self._queue.add(request.client, seq, self.max_batch_size - len(self._live))
            except Overloaded:
                self.counters.requests_rejected += 1
                raise
            self._next_id += 1
            self.counters.requests_submitted += 1
            self._work.notify_all()
            return seq.seq_id

    def cancel(self, seq_id: int) -> bool:
        """Cancel a queued or live request; it gets a final "cancelled" report. False if unknown."""
        with self._lock:
            seq = self._find(seq_id)
            if seq is None:
                return False
            self._drop(seq)
            self.counters.requests_cancelled += 1
            self._work.notify_all()
        self._deliver(_Events(reports=[(seq, StepReport([], 0, 0, 0, True, "cancelled"))]))
        return True

    def step(self) -> int:
        """Run one decode step for every live sequence; return how many were stepped."""
        with self._step_lock:
            with self._lock:
                expired = self._expire()
                self._rebalance()
                batch = list(self._live)
                releases, self._releases = self._releases, []
                prev = self._carry
            self._deliver(expired)
            if not batch and not releases:
                return 0
            outcomes, failures, prev, unsent = self._run(batch, releases, prev)
            with self._lock:
                self._carry = prev
                self._releases[:0] = unsent  # resent first, with the next step
                self._stalled = not batch and bool(unsent)
                self.counters.steps += 1
                events = self._apply(batch, outcomes, failures)
            self._deliver(events)
            return len(batch)

    def run_until_idle(self) -> None:
        """Step until no request is queued or live and every release has been sent.

        Also returns when a release-only step fails: its releases stay pending for the next step.
        """
        while self._has_work():
            self.step()
            if self._stalled:
                return

    def start(self) -> None:
        """Step on a background thread while there is work; sleep otherwise."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="avspec-scheduler", daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the background thread after its current step."""
        with self._lock:
            self._stopping = True
            self._work.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    # --- internals -------------------------------------------------------------------------

    def _need(self, request: GenerationRequest) -> int:
        """Positions a request may hold in the stages' caches at most."""
        return positions_needed(request, self.max_draft_tokens)

    def _drop(self, seq: SequenceState) -> None:
        """Take `seq` out of the queue or the batch (lock held); release what the stages hold."""
        if self._queue.remove(seq.request.client, seq):
            if seq.stepped:  # paused: the stages still hold its cache
                self._releases.append(seq.seq_id)
        else:
            self._retire(seq)

    def _expire(self) -> _Events:
        """End every request past its deadline with RequestTimedOut (lock held)."""
        events = _Events()
        if self.request_timeout_s is None:
            return events
        now = self.clock()
        for seq in [s for s in (*self._queue, *self._live) if now >= s.deadline]:
            self._drop(seq)
            self.counters.requests_timed_out += 1
            events.errors.append((seq, RequestTimedOut(
                f"request ran past the server's limit of {self.request_timeout_s:g} s per "
                f"request (request_timeout_s) after {seq.generated} of {seq.request.max_tokens} "
                "tokens; ask for fewer tokens or raise the limit"
            )))  # fmt: skip
        return events

    def _rebalance(self) -> None:
        """Pause sequences over their client's fair quota, then fill the free slots (lock held;
        avspec.engine.rebalance)."""
        self.counters.preemptions += rebalance(
            self._live, self._queue, self.max_batch_size, self.max_resident,
            self.kv_pool_tokens, self._need,
        )  # fmt: skip

    def _find(self, seq_id: int) -> SequenceState | None:
        for seq in (*self._queue, *self._live):
            if seq.seq_id == seq_id:
                return seq
        return None

    def _has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._live or self._releases)

    def _run(
        self, batch: list[SequenceState], releases: list[int], prev: Carry
    ) -> tuple[dict[int, Outcome], dict[int, Exception], Carry, list[int]]:
        """Call step_fn on the batch, each sequence alone if that fails (avspec.engine.step_call).

        Returns (outcomes, failures, the carry for the next step, releases whose every carrying
        call raised).
        """
        return call_step(
            self.step_fn, batch, releases, prev, self._guard, self.max_draft_tokens,
            self._count_step_failure,
        )  # fmt: skip

    def _count_step_failure(self) -> None:
        with self._lock:
            self.counters.step_failures += 1

    def _apply(
        self,
        batch: list[SequenceState],
        outcomes: dict[int, Outcome],
        failures: dict[int, Exception],
    ) -> _Events:
        """Commit step results (lock held); sequences cancelled meanwhile are skipped."""
        events = _Events()
        for seq in batch:
            if seq not in self._live:
                continue
            if seq.seq_id in failures:
                self._retire(seq)
                self.counters.requests_failed += 1
                events.errors.append((seq, failures[seq.seq_id]))
                continue
            report = self._advance(seq, outcomes[seq.seq_id])
            if not report.prefilling:
                events.reports.append((seq, report))
        return events

    def _advance(self, seq: SequenceState, outcome: Outcome) -> StepReport:
        """Commit one outcome to its sequence (lock held); count it, retire a finished one."""
        report = seq.commit(outcome, self.eos_ids)
        c = self.counters
        c.tokens_generated += len(report.new_tokens)
        c.drafted += report.drafted
        c.verified += report.verified
        c.accepted += report.accepted
        if report.finished:
            self._retire(seq)
            c.requests_finished += 1
        return report

    def _retire(self, seq: SequenceState) -> None:
        self._live.remove(seq)
        self._releases.append(seq.seq_id)

    def _deliver(self, events: _Events) -> None:
        """Run callbacks without the lock; a raising on_step fails only its own request."""
        for seq, report in events.reports:
            try:
                seq.on_step(report)
            except Exception as exc:  # noqa: BLE001 - a client callback must not kill the loop
                logger.exception("on_step of sequence %d raised", seq.seq_id)
                with self._lock:
                    self.counters.callback_errors += 1
                    if seq in self._live:
                        self._retire(seq)
                        self.counters.requests_failed += 1
                if not report.finished:
                    events.errors.append((seq, exc))
        for seq, error in events.errors:
            try:
                seq.on_error(error)
            except Exception:  # noqa: BLE001
                logger.exception("on_error of sequence %d raised", seq.seq_id)
                with self._lock:
                    self.counters.callback_errors += 1

    def _loop(self) -> None:
        while True:
            with self._work:
                while not self._stopping and not self._has_work():
                    self._work.wait()
                if self._stopping:
                    return
            try:
                self.step()
                if self._stalled:  # the step function is down: retry soon, or on new work
                    with self._work:
                        self._work.wait(_RETRY_S)
            except Exception as exc:  # noqa: BLE001 - a scheduler bug: fail everyone, keep serving
                logger.exception("scheduler step crashed")
                with self._lock:
                    doomed = list(self._live)
                    for seq in doomed:
                        self._retire(seq)
                    self.counters.requests_failed += len(doomed)
                self._deliver(_Events(errors=[(seq, exc) for seq in doomed]))
