"""The entry model's intake: check a request at once, tokenize it off the serving path, submit it.

Triton calls the entry model's `execute` on one thread: whatever it does there delays every
other client's next request. Tokenizing a long prompt there (seconds for a megabyte, with the
GIL held) did exactly that. So `execute` only checks a request's inputs (`EntryIntake.check`:
`parse_prompt_request`, cheap, and an oversized prompt is refused by its byte length, less the
bytes the tokenizer drops without a token, against the bound
`avspec.serving.stages.prompt_bound.prompt_bound_of` derives once from the tokenizer) and
hands it to `EntryIntake.submit`, whose worker threads tokenize it and submit it to the
scheduler; `execute` returns at once and the scheduler thread keeps stepping.

Fairness of the intake itself: requests wait per client and are taken round robin
(`AdmissionQueue`, with the entry's `max_queued` / `max_queued_per_client` as its limits, so a
flood is refused with "overloaded ...; retry" before it is tokenized), and each client has at
most one tokenization in flight, so with two workers a client is never queued behind another
client's backlog, at worst behind one tokenization of the largest admissible prompt.

What happens to each request is told to its `RequestSink`: `refused` (invalid or overloaded
after queueing, or the intake stopped) or `admitted` with its sequence id, then the scheduler's
`on_step` / `on_error`.

`entry_scheduler` builds the entry's `Scheduler` from its parameters and the stage configs next
to it (`stage_limits`: their KV slots bound the sequences live or paused, their idle sweep the
useful request time limit).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from avspec.config import from_parameters
from avspec.engine.admission import AdmissionQueue
from avspec.engine.scheduler import Scheduler, StepFn
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import StepReport
from avspec.runtime.tokenizer import Tokenizer
from avspec.serving.repository import EntryParams, read_config_parameters
from avspec.serving.stages.prompt_bound import prompt_bound_of
from avspec.serving.stages.requests import PromptRequest, parse_prompt_request

logger = logging.getLogger(__name__)

STAGE_MODELS = ("draft", "target")  # the models whose KV caches hold the entry's sequences
DEFAULT_WORKERS = 2


class RequestSink(Protocol):
    """Where one request's fate goes (the entry model's per-request response sender)."""

    def tokenized(self, prompt_tokens: int) -> None:
        """The prompt is `prompt_tokens` tokens long (told before the scheduler sees it)."""

    def admitted(self, seq_id: int) -> None:
        """The scheduler took the request as sequence `seq_id` (may come after its first step)."""

    def refused(self, error: Exception) -> None:
        """The request never reached the scheduler: RequestError / ValueError (invalid),
        Overloaded (a queue is full), or another error."""

    def on_step(self, report: StepReport) -> None:
        """The scheduler's report of one step (`Scheduler.submit`'s on_step)."""

    def on_error(self, error: Exception) -> None:
        """Generation failed or ran past its time limit (`Scheduler.submit`'s on_error)."""


@dataclass(frozen=True)
class StageLimits:
    """What the stage configs say about holding the entry's sequences (None: not stated)."""

    max_sequences: int | None = None  # the fewest KV cache slots of the stages
    idle_timeout_s: float | None = None  # the shortest idle sweep of the stages
    kv_pool_tokens: int | None = None  # the smallest shared KV pool of the stages


@dataclass(frozen=True)
class _StageConfig:
    max_sequences: int | None = None
    idle_timeout_s: float | None = None
    max_length: int | None = None
    kv_pool_tokens: int = 0

    @property
    def pool(self) -> int | None:
        """The cells of the stage's shared KV pool (either engine; None: not stated)."""
        return self.kv_pool_tokens or (self.max_sequences or 0) * (self.max_length or 0) or None


def stage_limits(model_directory: str | Path) -> StageLimits:
    """`StageLimits` from the `draft` and `target` config.pbtxt next to the entry model whose
    directory is `model_directory` (Triton's `args["model_repository"]`); a missing config or
    parameter states nothing."""
    slots, idle, pools = [], [], []
    for model in STAGE_MODELS:
        config = Path(model_directory).parent / model / "config.pbtxt"
        if not config.is_file():
            continue
        params = read_config_parameters(config.read_text())
        names = {f.name for f in dataclasses.fields(_StageConfig)}
        stage = from_parameters(_StageConfig, {k: v for k, v in params.items() if k in names})
        if stage.max_sequences is not None:
            slots.append(stage.max_sequences)
        if stage.idle_timeout_s is not None:
            idle.append(stage.idle_timeout_s)
        if stage.pool is not None:
            pools.append(stage.pool)
    return StageLimits(min(slots, default=None), min(idle, default=None), min(pools, default=None))


def entry_scheduler(
    step_fn: StepFn,
    eos_ids: Collection[int],
    params: EntryParams,
    limits: StageLimits,
    **kw: Any,
) -> Scheduler:
    """The entry's Scheduler: its parameters, at most `limits.max_sequences` sequences live or
    paused, and the per-request time limit (warned about when the stages' idle sweep could free
    a paused sequence first). `kw` goes to the Scheduler (e.g. `first_seq_id`)."""
    timeout = params.request_timeout_s or None
    idle = limits.idle_timeout_s
    if idle is not None and (timeout is None or timeout > idle):
        logger.warning(
            "request_timeout_s %s exceeds the stages' idle_timeout_s %s: a sequence paused for "
            "the fair share that long is freed by the stages and its request fails",
            params.request_timeout_s or "0 (none)", idle,
        )  # fmt: skip
    resident = limits.max_sequences
    if resident is not None and resident < params.max_batch_size:
        raise ValueError(
            f"max_batch_size {params.max_batch_size} exceeds the stages' max_sequences {resident}"
        )
    bounds = SchedulerLimits(
        max_queued=params.max_queued, max_queued_per_client=params.max_queued_per_client,
        max_resident=resident, request_timeout_s=timeout, kv_pool_tokens=limits.kv_pool_tokens,
        prefill_chunk=params.prefill_chunk, refit_max_temperature=params.refit_max_temperature,
        refit_client_share=params.refit_client_share,
    )  # fmt: skip
    return Scheduler(
        step_fn, eos_ids, params.max_batch_size, params.max_context, params.max_draft_tokens,
        limits=bounds, **kw,
    )  # fmt: skip


@dataclass(eq=False)
class _Pending:
    prompt: PromptRequest
    sink: RequestSink


class EntryIntake:
    """Tokenize checked requests on worker threads and submit them to the scheduler.

    Thread-safe; neither `check` nor `submit` tokenizes or waits for a tokenization. The wait
    queue's limits are the entry's `max_queued` / `max_queued_per_client`.
    """

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        params: EntryParams,
        workers: int = DEFAULT_WORKERS,
    ) -> None:
        if workers < 1:
            raise ValueError(f"workers must be >= 1, got {workers}")
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.params = params
        self.prompt_bound = prompt_bound_of(tokenizer)  # None: prompts have no byte bound
        if self.prompt_bound is None:
            logger.warning(
                "no sound bytes-per-token bound for %r: prompts are tokenized in full before "
                "the context check", tokenizer,
            )  # fmt: skip
        self.workers = workers
        self._queue: AdmissionQueue[_Pending] = AdmissionQueue(
            params.max_queued, params.max_queued_per_client
        )
        self._busy: Counter[str] = Counter()  # client -> tokenizations in flight
        self._work = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._stopping = False

    @property
    def pending_count(self) -> int:
        """Requests waiting for or in tokenization."""
        with self._work:
            return len(self._queue) + sum(self._busy.values())

    def check(self, values: Mapping[str, np.ndarray | None], client: str) -> PromptRequest:
        """`parse_prompt_request` of one request's inputs, with the tokenizer's byte bound;
        RequestError naming the input (an oversized `text_input` included, untokenized)."""
        return parse_prompt_request(values, self.params, client, self.prompt_bound)

    def submit(self, prompt: PromptRequest, sink: RequestSink) -> None:
        """Queue `prompt` for tokenization; Overloaded (nothing queued) past a queue limit."""
        client = prompt.settings.client
        with self._work:
            if self._stopping:
                raise RuntimeError("the entry model is stopping")
            self._queue.add(client, _Pending(prompt, sink), free_slots=0)
            self._work.notify()

    def start(self) -> None:
        """Start the worker threads (idempotent)."""
        with self._work:
            self._stopping = False
            self._threads = [t for t in self._threads if t.is_alive()]
            while len(self._threads) < self.workers:
                thread = threading.Thread(
                    target=self._loop, name=f"avspec-intake-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()

    def stop(self, timeout_s: float | None = None) -> None:
        """Stop the workers after their current request; refuse what still waits."""
        with self._work:
            self._stopping = True
            self._work.notify_all()
            left = self._queue.pop(len(self._queue))
        for pending in left:
            _tell(pending.sink.refused, RuntimeError("the entry model is stopping"))
        for thread in self._threads:
            thread.join(timeout_s)

    def _take(self) -> _Pending | None:
        """The next request, round robin over clients with none in flight; None: stopping."""
        with self._work:
            while True:
                if self._stopping:
                    return None
                taken = self._queue.pop(1, lambda client, _: self._busy[client] == 0)
                if taken:
                    self._busy[taken[0].prompt.settings.client] += 1
                    return taken[0]
                self._work.wait()

    def _loop(self) -> None:
        while (pending := self._take()) is not None:
            try:
                self._admit(pending)
            finally:
                with self._work:
                    client = pending.prompt.settings.client
                    self._busy[client] -= 1
                    if not self._busy[client]:
                        del self._busy[client]
                    self._work.notify_all()

    def _admit(self, pending: _Pending) -> None:
        prompt, sink = pending.prompt, pending.sink
        try:
            request = prompt.tokenize(self.tokenizer)
            sink.tokenized(len(request.prompt_ids))
            seq_id = self.scheduler.submit(request, sink.on_step, sink.on_error)
        except Exception as err:  # noqa: BLE001 - every request gets an answer
            _tell(sink.refused, err)
            return
        _tell(sink.admitted, seq_id)


def _tell(callback: Callable[[Any], None], value: object) -> None:
    """Call a sink method; one that raises is logged, never kills a worker."""
    try:
        callback(value)
    except Exception:  # noqa: BLE001
        logger.exception("request sink %s raised", getattr(callback, "__name__", callback))
