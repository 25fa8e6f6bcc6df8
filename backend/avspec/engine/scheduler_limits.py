"""The scheduler's optional bounds, passed to `Scheduler` once as one value.

Every bound defaults to off: unbounded queues and residency, no wall-clock limit, a whole prompt
sent in one step, every row labelled for the refit. The served entry model sets them from its
parameters and the stage configs next to it (avspec.serving.stages.entry, docs/serving.md).
`Scheduler` checks them against its batch size and draft length when it is built.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SchedulerLimits:
    """What a `Scheduler` bounds besides its batch, context and draft length.

    - `max_queued` / `max_queued_per_client`: the admission queue's limits, all clients together
      and per client (avspec.engine.admission; None: unbounded);
    - `max_resident`: sequences live or paused at once, >= the batch size (None: unbounded);
    - `request_timeout_s`: the wall-clock limit of a request since `submit` (None: none);
    - `kv_pool_tokens`: the stages keep every sequence's keys and values in one shared pool of
      that many cells: a request is admitted only while the admitted ones' prompt + max_tokens
      + K fit in it together, never ahead of an older one still waiting for cells, and one that
      could never fit is refused (None: each sequence has its own `max_context` slot);
    - `prefill_chunk`: a longer prompt is sent that many tokens a step (`SequenceState.sent`),
      so the rows decoding beside it are not stalled for the whole prompt (0: all at once);
    - `refit_max_temperature` / `refit_client_share`: the refit guard's bounds
      (avspec.engine.refit_guard; inf and 1: every row labelled).
    """

    max_queued: int | None = None
    max_queued_per_client: int | None = None
    max_resident: int | None = None
    request_timeout_s: float | None = None
    kv_pool_tokens: int | None = None
    prefill_chunk: int = 0
    refit_max_temperature: float = math.inf
    refit_client_share: float = 1.0


UNLIMITED = SchedulerLimits()  # every bound off: `Scheduler`'s default
