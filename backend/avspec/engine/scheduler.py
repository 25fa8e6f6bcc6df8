"""In-flight batching: admit requests, run one speculative step for all live sequences, stream.

Pure Python around a `step_fn(StepInputs) -> StepOutputs` (the in-process `SpeculativeStep` or
the Triton step ensemble). Per sequence the scheduler keeps the contract's bookkeeping
(docs/architecture.md): `input_ids` are the tokens committed since the last step (the prompt on
the first step, then last step's accepted drafts and its correction/bonus token), `reusable` the
number of those that were drafts, `start_positions` the committed length before them.

- Admission control: `submit` raises `Overloaded` (nothing enqueued, `requests_rejected`
  counted) when the wait queue already holds `max_queued` requests, or the request's client
  `max_queued_per_client`, beyond the batch's free slots (requests the next step boundary will
  admit anyway do not count). The limits are checked at submission; None means unbounded.
- Fairness: queued requests join the batch at a step boundary, one per client in turn (round
  robin over the clients with queued work, each client's own requests FIFO; the anonymous client
  "" is one client). A request at the head of its client's queue is admitted within C
  admissions, C = the clients with queued work at that moment (clients arriving later queue
  behind it), so a burst from one client cannot starve another.
- A request drafts at most `max_tokens - generated - 1` tokens, so no step overshoots its budget
  (fewer verified drafts never changes the output distribution).
- EOS ends a request and is not emitted; `max_tokens` is honoured exactly.
- Error isolation: if `step_fn` raises, the step is replayed for each sequence alone (the cache
  rule makes a replay safe; replays send an empty `prev_num_accepted`). A sequence that still
  fails alone gets `on_error` and is released; the others continue. A callback that raises
  fails only its own request (its stream is broken); the loop goes on.
- Finished, cancelled and failed sequences go out in the next step's `release_seq_ids`; with no
  live sequence left, an empty-batch step carries them. Releases are never lost: a call that
  raised hands its releases to the next call (a release is idempotent on the stages).
- Refit guard: the `prev_num_accepted` sent with the next step marks, with
  `avspec.av.estimator.refit_excluded` (a accepted drafts sent as -1 - a), the rows whose outcome
  does not feed the refit: (a) rows whose temperature exceeds `refit_max_temperature` (both
  distributions flatten towards uniform, acceptance approaches 1 whatever q_max says, so such
  traffic would drag the slope down) and (b) rows over a client's share: of a step's n rows, one
  client labels at most max(1, floor(s n)) rows, s = `refit_client_share`, taken in seq-id order
  round robin from where its last labelled row left off, so each of its sequences is labelled in
  turn. No single client supplies more than max(1, floor(s n)) of the n sequence-steps of any
  step, hence at most share s (plus one row per step) of a refit window.
"""

from __future__ import annotations

import bisect
import logging
import math
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from avspec.av.estimator import refit_excluded
from avspec.contract import StepInputs, StepOutputs

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInputs], StepOutputs]

MAX_TEMPERATURE = 100.0  # a request's largest temperature (at 100 sampling is near uniform)
_RETRY_S = 0.5  # background loop: wait after a release-only step failed before resending


class Overloaded(RuntimeError):
    """The wait queue is full for this request; the message says which limit and to retry."""


@dataclass
class GenerationRequest:
    """One generation request; `num_draft_tokens` 0 turns speculation off for it.

    `client` is the identity fairness and the refit share are counted by ("" = anonymous, one
    client).
    """

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    random_seed: int = 0
    num_draft_tokens: int = 8
    adaptive: bool = True
    client: str = ""


@dataclass
class StepReport:
    """What one step did for one request; `finish_reason` is "stop", "length" or "cancelled"."""

    new_tokens: list[int]
    drafted: int
    verified: int
    accepted: int
    finished: bool
    finish_reason: str | None


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
    callback_errors: int = 0
    tokens_generated: int = 0
    drafted: int = 0
    verified: int = 0
    accepted: int = 0


@dataclass(eq=False)
class _Sequence:
    seq_id: int
    request: GenerationRequest
    on_step: Callable[[StepReport], None]
    on_error: Callable[[Exception], None]
    pending: list[int]  # committed tokens not yet sent to the models
    start: int = 0
    reusable: int = 0
    generated: int = 0

    def drafts_wanted(self) -> int:
        return max(
            0, min(self.request.num_draft_tokens, self.request.max_tokens - self.generated - 1)
        )


@dataclass
class _Outcome:
    tokens: list[int]  # num_accepted + 1 output tokens
    verified: int
    accepted: int


@dataclass
class _Events:
    """Callbacks to run after the lock is dropped."""

    reports: list[tuple[_Sequence, StepReport]] = field(default_factory=list)
    errors: list[tuple[_Sequence, Exception]] = field(default_factory=list)


class Scheduler:
    """Thread-safe in-flight batching scheduler over a step function.

    The admission limits and the refit guard default to off (unbounded queue, every row
    labelled); the served entry model sets them from its parameters (docs/serving.md).
    """

    def __init__(
        self,
        step_fn: StepFn,
        eos_id: int,
        max_batch_size: int,
        max_context: int,
        max_draft_tokens: int,
        *,
        max_queued: int | None = None,
        max_queued_per_client: int | None = None,
        refit_max_temperature: float = math.inf,
        refit_client_share: float = 1.0,
        first_seq_id: int = 1,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        if max_context < 2 + max_draft_tokens:
            raise ValueError(f"max_context {max_context} leaves no room for a prompt and a token")
        limits = {"max_queued": max_queued, "max_queued_per_client": max_queued_per_client}
        for name, limit in limits.items():
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {limit}")
        if not refit_max_temperature >= 0:
            raise ValueError(f"refit_max_temperature must be >= 0, got {refit_max_temperature}")
        if not 1 <= first_seq_id < 1 << 62:
            raise ValueError(f"first_seq_id must lie in 1..2^62-1, got {first_seq_id}")
        if not 0 < refit_client_share <= 1:
            raise ValueError(f"refit_client_share must lie in (0, 1], got {refit_client_share}")
        self.step_fn = step_fn
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.max_draft_tokens = max_draft_tokens
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        self.refit_max_temperature = refit_max_temperature
        self.refit_client_share = refit_client_share
        self.counters = SchedulerCounters()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        # client -> its queued requests (FIFO); key order is the round-robin order
        self._queues: OrderedDict[str, deque[_Sequence]] = OrderedDict()
        self._live: list[_Sequence] = []
        self._releases: list[int] = []
        self._prev_accepted = torch.zeros(0, dtype=torch.int32)
        self._label_cursor: dict[str, int] = {}  # client -> seq id of its last labelled row
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
            return sum(len(queue) for queue in self._queues.values())

    def queued_by_client(self) -> dict[str, int]:
        """Waiting requests per client (clients with none are absent)."""
        with self._lock:
            return {client: len(queue) for client, queue in self._queues.items()}

    def submit(
        self,
        request: GenerationRequest,
        on_step: Callable[[StepReport], None],
        on_error: Callable[[Exception], None],
    ) -> int:
        """Validate and enqueue `request`; return its sequence id.

        Raises ValueError if invalid, Overloaded if a queue limit is reached.
        """
        self._validate(request)
        with self._lock:
            self._check_room(request.client)
            seq = _Sequence(self._next_id, request, on_step, on_error, list(request.prompt_ids))
            self._next_id += 1
            self._queues.setdefault(request.client, deque()).append(seq)
            self.counters.requests_submitted += 1
            self._work.notify_all()
            return seq.seq_id

    def cancel(self, seq_id: int) -> bool:
        """Cancel a queued or live request; it gets a final "cancelled" report. False if unknown."""
        with self._lock:
            seq = self._find(seq_id)
            if seq is None:
                return False
            queue = self._queues.get(seq.request.client)
            if queue is not None and seq in queue:
                queue.remove(seq)
                if not queue:
                    del self._queues[seq.request.client]
            else:
                self._live.remove(seq)
                self._releases.append(seq_id)
            self.counters.requests_cancelled += 1
            self._work.notify_all()
        self._deliver(_Events(reports=[(seq, StepReport([], 0, 0, 0, True, "cancelled"))]))
        return True

    def step(self) -> int:
        """Run one decode step for every live sequence; return how many were stepped."""
        with self._step_lock:
            with self._lock:
                self._admit()
                batch = list(self._live)
                releases, self._releases = self._releases, []
                prev = self._prev_accepted
            if not batch and not releases:
                return 0
            outcomes, failures, prev, unsent = self._run(batch, releases, prev)
            with self._lock:
                self._prev_accepted = prev
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

    def _validate(self, request: GenerationRequest) -> None:
        if not request.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {request.max_tokens}")
        if not 0 <= request.num_draft_tokens <= self.max_draft_tokens:
            raise ValueError(
                f"num_draft_tokens {request.num_draft_tokens} outside 0..{self.max_draft_tokens}"
            )
        if not 0 <= request.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must lie in 0..{MAX_TEMPERATURE:g} (0 = greedy), "
                f"got {request.temperature}"
            )
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {request.top_p}")
        if not isinstance(request.client, str):
            raise ValueError(f"client must be a string, got {type(request.client).__name__}")
        need = len(request.prompt_ids) + request.max_tokens + self.max_draft_tokens
        if need > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.max_tokens}) + "
                f"draft tokens ({self.max_draft_tokens}) = {need} exceeds max_context "
                f"{self.max_context}"
            )

    def _check_room(self, client: str) -> None:
        """Raise Overloaded if a queue limit is reached (lock held); free batch slots are room."""
        free = max(0, self.max_batch_size - len(self._live))
        total = sum(len(queue) for queue in self._queues.values())
        mine = len(self._queues.get(client, ()))
        for limit, queued, whose in (
            (self.max_queued, total, ""),
            (self.max_queued_per_client, mine, " for this client"),
        ):
            if limit is not None and queued - free >= limit:
                self.counters.requests_rejected += 1
                raise Overloaded(
                    f"overloaded: {queued - free} requests queued{whose} (limit {limit}); "
                    "retry later"
                )

    def _admit(self) -> None:
        """Move queued requests into free batch slots, one per client in turn (lock held)."""
        while self._queues and len(self._live) < self.max_batch_size:
            client, queue = next(iter(self._queues.items()))
            self._live.append(queue.popleft())
            del self._queues[client]
            if queue:
                self._queues[client] = queue  # to the back of the rotation

    def _find(self, seq_id: int) -> _Sequence | None:
        for seq in (*(s for q in self._queues.values() for s in q), *self._live):
            if seq.seq_id == seq_id:
                return seq
        return None

    def _has_work(self) -> bool:
        with self._lock:
            return bool(self._queues or self._live or self._releases)

    def _run(
        self, batch: list[_Sequence], releases: list[int], prev: torch.Tensor
    ) -> tuple[dict[int, _Outcome], dict[int, Exception], torch.Tensor, list[int]]:
        """Call step_fn on the batch; on failure replay each sequence alone.

        Returns (outcomes, failures, prev_num_accepted for the next step, releases whose every
        carrying call raised).
        """
        empty = torch.zeros(0, dtype=torch.int32)
        try:
            outputs = self.step_fn(_build_inputs(batch, releases, prev))
            releases = []  # the call returned: every stage has freed them
            outcomes = _read_outputs(outputs, batch, self.max_draft_tokens)
            return outcomes, {}, self._refit_outcomes(batch, outcomes), []
        except Exception as exc:  # noqa: BLE001 - isolate the failing sequence below
            if not batch:
                logger.warning("release-only step failed (%s); releases kept for the next", exc)
                return {}, {}, empty, releases
            logger.warning(
                "step of %d sequences failed (%s); replaying each alone", len(batch), exc
            )
            with self._lock:
                self.counters.step_failures += 1
        outcomes, failures = {}, {}
        for seq in batch:
            try:
                outputs = self.step_fn(_build_inputs([seq], releases, empty))
                releases = []
                outcomes.update(_read_outputs(outputs, [seq], self.max_draft_tokens))
            except Exception as exc:  # noqa: BLE001 - reported through on_error
                failures[seq.seq_id] = exc
        return outcomes, failures, empty, releases

    def _refit_outcomes(
        self, batch: list[_Sequence], outcomes: dict[int, _Outcome]
    ) -> torch.Tensor:
        """prev_num_accepted [batch] int32 for the next step, rows kept out of the refit encoded
        by `refit_excluded`."""
        values = [outcomes[seq.seq_id].accepted for seq in batch]
        excluded: set[int] = set()
        rows: dict[str, list[int]] = {}  # client -> its rows that would be labelled
        for row, seq in enumerate(batch):
            if seq.request.temperature > self.refit_max_temperature:
                excluded.add(row)
            elif outcomes[seq.seq_id].verified > 0:
                rows.setdefault(seq.request.client, []).append(row)
        # 1e-9: a float product like 0.29 * 100 = 28.999999999999996 must still give 29
        cap = max(1, math.floor(self.refit_client_share * len(batch) + 1e-9))
        cursors = {}
        for client, mine in rows.items():
            cursors[client] = self._label_cursor.get(client, 0)
            if len(mine) <= cap:
                continue
            by_id = {batch[row].seq_id: row for row in mine}
            chosen = _round_robin(sorted(by_id), cursors[client], cap)
            cursors[client] = chosen[-1]
            excluded.update(by_id[seq_id] for seq_id in by_id.keys() - set(chosen))
        self._label_cursor = cursors
        values = torch.tensor(values, dtype=torch.int32)
        rows_out = torch.tensor(sorted(excluded), dtype=torch.long)
        values[rows_out] = refit_excluded(values[rows_out])
        return values

    def _apply(
        self, batch: list[_Sequence], outcomes: dict[int, _Outcome], failures: dict[int, Exception]
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
            events.reports.append((seq, self._advance(seq, outcomes[seq.seq_id])))
        return events

    def _advance(self, seq: _Sequence, outcome: _Outcome) -> StepReport:
        drafted = seq.drafts_wanted()
        emitted: list[int] = []
        reason = None
        for token in outcome.tokens:
            if token == self.eos_id:
                reason = "stop"
                break
            emitted.append(token)
            if seq.generated + len(emitted) == seq.request.max_tokens:
                reason = "length"
                break
        seq.start += len(seq.pending)
        seq.pending = outcome.tokens
        seq.reusable = outcome.accepted
        seq.generated += len(emitted)
        c = self.counters
        c.tokens_generated += len(emitted)
        c.drafted += drafted
        c.verified += outcome.verified
        c.accepted += outcome.accepted
        if reason is not None:
            self._retire(seq)
            c.requests_finished += 1
        return StepReport(
            emitted, drafted, outcome.verified, outcome.accepted, reason is not None, reason
        )

    def _retire(self, seq: _Sequence) -> None:
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
        for seq, exc in events.errors:
            try:
                seq.on_error(exc)
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


def _round_robin(ids: list[int], cursor: int, count: int) -> list[int]:
    """`count` of the sorted `ids`, cyclically from the first one above `cursor`."""
    start = bisect.bisect_right(ids, cursor)
    return [ids[(start + i) % len(ids)] for i in range(count)]


def _build_inputs(batch: list[_Sequence], releases: list[int], prev: torch.Tensor) -> StepInputs:
    """The contract's CPU tensors for `batch` (see docs/architecture.md)."""
    width = max((len(s.pending) for s in batch), default=1)
    input_ids = torch.zeros(len(batch), width, dtype=torch.int32)
    for row, seq in enumerate(batch):
        input_ids[row, : len(seq.pending)] = torch.tensor(seq.pending, dtype=torch.int32)

    def column(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype)

    return StepInputs(
        seq_ids=column([s.seq_id for s in batch], torch.int64),
        input_ids=input_ids,
        input_lengths=column([len(s.pending) for s in batch], torch.int32),
        start_positions=column([s.start for s in batch], torch.int32),
        reusable=column([s.reusable for s in batch], torch.int32),
        num_draft_tokens=column([s.drafts_wanted() for s in batch], torch.int32),
        adaptive=column([s.request.adaptive for s in batch], torch.bool),
        temperature=column([s.request.temperature for s in batch], torch.float32),
        top_p=column([s.request.top_p for s in batch], torch.float32),
        random_seed=column([s.request.random_seed for s in batch], torch.int64),
        prev_num_accepted=prev,
        release_seq_ids=column(releases, torch.int64),
    )


def _read_outputs(
    outputs: StepOutputs, batch: list[_Sequence], max_draft_tokens: int
) -> dict[int, _Outcome]:
    """Host copies of the step outputs per sequence; ValueError on a malformed result."""
    n = len(batch)
    output_ids = outputs.output_ids.detach().cpu()
    if tuple(output_ids.shape) != (n, max_draft_tokens + 1):
        raise ValueError(
            f"output_ids has shape {tuple(output_ids.shape)}, want {(n, max_draft_tokens + 1)}"
        )
    accepted = outputs.num_accepted.detach().cpu().tolist()
    verified = outputs.num_verify.detach().cpu().tolist()
    if len(accepted) != n or len(verified) != n:
        raise ValueError(f"num_accepted / num_verify must hold {n} entries")
    rows = output_ids.tolist()
    outcomes = {}
    for seq, row, a, v in zip(batch, rows, accepted, verified, strict=True):
        if not 0 <= a <= v <= seq.drafts_wanted():
            raise ValueError(
                f"sequence {seq.seq_id}: num_accepted {a}, num_verify {v} out of range"
            )
        outcomes[seq.seq_id] = _Outcome(row[: a + 1], v, a)
    return outcomes


def generate(
    runner: Scheduler | StepFn,
    requests: Sequence[GenerationRequest],
    *,
    eos_id: int = 256,
    max_batch_size: int | None = None,
    max_context: int = 512,
    max_draft_tokens: int | None = None,
) -> list[list[int]]:
    """Run `requests` to completion and return each one's tokens (tests and benchmarks).

    `runner` is a Scheduler or a step function (then `max_draft_tokens` defaults to its
    `max_draft_tokens` attribute). Raises RuntimeError if any request fails.
    """
    if isinstance(runner, Scheduler):
        scheduler = runner
    else:
        k = max_draft_tokens if max_draft_tokens is not None else runner.max_draft_tokens
        size = max_batch_size or max(1, len(requests))
        scheduler = Scheduler(runner, eos_id, size, max_context, k)
    tokens: list[list[int]] = [[] for _ in requests]
    errors: list[Exception] = []
    for i, request in enumerate(requests):
        scheduler.submit(request, lambda r, i=i: tokens[i].extend(r.new_tokens), errors.append)
    scheduler.run_until_idle()
    if errors:
        raise RuntimeError(f"{len(errors)} request(s) failed; first: {errors[0]!r}") from errors[0]
    return tokens
