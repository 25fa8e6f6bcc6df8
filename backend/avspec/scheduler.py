"""In-flight batching: admit requests, run one speculative step for all live sequences, stream.

Pure Python around a `step_fn(StepInputs) -> StepOutputs` (the in-process `SpeculativeStep` or
the Triton step ensemble). Per sequence the scheduler keeps the contract's bookkeeping
(docs/architecture.md): `input_ids` are the tokens committed since the last step (the prompt on
the first step, then last step's accepted drafts and its correction/bonus token), `reusable` the
number of those that were drafts, `start_positions` the committed length before them.

- Requests beyond `max_batch_size` wait in a FIFO queue and join at a step boundary.
- A request drafts at most `max_tokens - generated - 1` tokens, so no step overshoots its budget
  (fewer verified drafts never changes the output distribution).
- EOS ends a request and is not emitted; `max_tokens` is honoured exactly.
- Error isolation: if `step_fn` raises, the step is replayed for each sequence alone (the cache
  rule makes a replay safe; replays send an empty `prev_num_accepted`). A sequence that still
  fails alone gets `on_error` and is released; the others continue. A callback that raises
  fails only its own request (its stream is broken); the loop goes on.
- Finished, cancelled and failed sequences go out in the next step's `release_seq_ids`; with no
  live sequence left, an empty-batch step carries them.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from avspec.speculative_step import StepInputs, StepOutputs

logger = logging.getLogger(__name__)

StepFn = Callable[[StepInputs], StepOutputs]


@dataclass
class GenerationRequest:
    """One generation request; `num_draft_tokens` 0 turns speculation off for it."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    random_seed: int = 0
    num_draft_tokens: int = 8
    adaptive: bool = True


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
    """Thread-safe in-flight batching scheduler over a step function."""

    def __init__(
        self,
        step_fn: StepFn,
        eos_id: int,
        max_batch_size: int,
        max_context: int,
        max_draft_tokens: int,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_draft_tokens < 0:
            raise ValueError(f"max_draft_tokens must be >= 0, got {max_draft_tokens}")
        if max_context < 2 + max_draft_tokens:
            raise ValueError(f"max_context {max_context} leaves no room for a prompt and a token")
        self.step_fn = step_fn
        self.eos_id = eos_id
        self.max_batch_size = max_batch_size
        self.max_context = max_context
        self.max_draft_tokens = max_draft_tokens
        self.counters = SchedulerCounters()
        self._lock = threading.RLock()
        self._work = threading.Condition(self._lock)
        self._step_lock = threading.Lock()
        self._queue: deque[_Sequence] = deque()
        self._live: list[_Sequence] = []
        self._releases: list[int] = []
        self._prev_accepted = torch.zeros(0, dtype=torch.int32)
        self._next_id = 1
        self._thread: threading.Thread | None = None
        self._stopping = False

    @property
    def live_count(self) -> int:
        """Sequences admitted to the batch (not counting the queue)."""
        with self._lock:
            return len(self._live)

    @property
    def queued_count(self) -> int:
        with self._lock:
            return len(self._queue)

    def submit(
        self,
        request: GenerationRequest,
        on_step: Callable[[StepReport], None],
        on_error: Callable[[Exception], None],
    ) -> int:
        """Validate and enqueue `request`; return its sequence id. Raises ValueError if invalid."""
        self._validate(request)
        with self._lock:
            seq = _Sequence(self._next_id, request, on_step, on_error, list(request.prompt_ids))
            self._next_id += 1
            self._queue.append(seq)
            self.counters.requests_submitted += 1
            self._work.notify_all()
            return seq.seq_id

    def cancel(self, seq_id: int) -> bool:
        """Cancel a queued or live request; it gets a final "cancelled" report. False if unknown."""
        with self._lock:
            seq = self._find(seq_id)
            if seq is None:
                return False
            if seq in self._queue:
                self._queue.remove(seq)
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
                while self._queue and len(self._live) < self.max_batch_size:
                    self._live.append(self._queue.popleft())
                batch = list(self._live)
                releases, self._releases = self._releases, []
                prev = self._prev_accepted
            if not batch and not releases:
                return 0
            outcomes, failures, prev = self._run(batch, releases, prev)
            with self._lock:
                self._prev_accepted = prev
                self.counters.steps += 1
                events = self._apply(batch, outcomes, failures)
            self._deliver(events)
            return len(batch)

    def run_until_idle(self) -> None:
        """Step until no request is queued or live and every release has been sent."""
        while self._has_work():
            self.step()

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
        if not request.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {request.temperature}")
        if not 0 < request.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {request.top_p}")
        need = len(request.prompt_ids) + request.max_tokens + self.max_draft_tokens
        if need > self.max_context:
            raise ValueError(
                f"prompt ({len(request.prompt_ids)}) + max_tokens ({request.max_tokens}) + "
                f"draft tokens ({self.max_draft_tokens}) = {need} exceeds max_context "
                f"{self.max_context}"
            )

    def _find(self, seq_id: int) -> _Sequence | None:
        for seq in (*self._queue, *self._live):
            if seq.seq_id == seq_id:
                return seq
        return None

    def _has_work(self) -> bool:
        with self._lock:
            return bool(self._queue or self._live or self._releases)

    def _run(
        self, batch: list[_Sequence], releases: list[int], prev: torch.Tensor
    ) -> tuple[dict[int, _Outcome], dict[int, Exception], torch.Tensor]:
        """Call step_fn on the batch; on failure replay each sequence alone."""
        try:
            outputs = self.step_fn(_build_inputs(batch, releases, prev))
            outcomes = _read_outputs(outputs, batch, self.max_draft_tokens)
            return outcomes, {}, outputs.num_accepted.detach().to("cpu", torch.int32)
        except Exception as exc:  # noqa: BLE001 - isolate the failing sequence below
            if not batch:
                logger.warning("release-only step failed: %s", exc)
                return {}, {}, torch.zeros(0, dtype=torch.int32)
            logger.warning(
                "step of %d sequences failed (%s); replaying each alone", len(batch), exc
            )
            with self._lock:
                self.counters.step_failures += 1
        outcomes, failures = {}, {}
        empty = torch.zeros(0, dtype=torch.int32)
        for i, seq in enumerate(batch):
            try:
                outputs = self.step_fn(_build_inputs([seq], releases if i == 0 else [], empty))
                outcomes.update(_read_outputs(outputs, [seq], self.max_draft_tokens))
            except Exception as exc:  # noqa: BLE001 - reported through on_error
                failures[seq.seq_id] = exc
        return outcomes, failures, empty

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
            except Exception as exc:  # noqa: BLE001 - a scheduler bug: fail everyone, keep serving
                logger.exception("scheduler step crashed")
                with self._lock:
                    doomed = list(self._live)
                    for seq in doomed:
                        self._retire(seq)
                    self.counters.requests_failed += len(doomed)
                self._deliver(_Events(errors=[(seq, exc) for seq in doomed]))


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
