"""The batch at a step boundary: the fair share's pauses, then the free slots filled.

The scheduler (avspec.engine.scheduler) calls `rebalance` under its lock before each step, with
its live sequences and its `AdmissionQueue` (avspec.engine.admission, which states the quotas).

- Fair share of the batch: when a client waits, every client with more live sequences than its
  max-min fair quota (`fair_quotas`) has its excess paused, highest sequence ids (its latest
  requests) first. A paused sequence goes back to the front of its client's queue and keeps its
  stage state (`SequenceState.stepped`); it resumes where it stopped.
- Resident bound (`max_resident`, the stages' `max_sequences`): paused sequences still hold stage
  slots, so a request that has not started yet is admitted only while live + paused stay within
  it; a paused one can always resume.
- Shared KV pool (`kv_pool_tokens`): a new request is admitted only while every admitted one
  (paused ones too) can still reach its longest (`need`: prompt + max_tokens + K), so no step
  runs out of cells; and never ahead of an older new request still waiting for cells.
- Filling: clients under their quota first (round robin), then any admissible request, so no
  slot stays idle.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

from avspec.engine.admission import AdmissionQueue, fair_quotas
from avspec.engine.sequence import GenerationRequest, SequenceState


def rebalance(
    live: list[SequenceState],
    queue: AdmissionQueue[SequenceState],
    max_batch_size: int,
    max_resident: int | None,
    kv_pool_tokens: int | None,
    need: Callable[[GenerationRequest], int],
) -> int:
    """Pause sequences over their client's fair quota, then fill the free slots of `live` from
    `queue` (both changed in place); return how many sequences were paused.

    Demand per client: live + paused + the not-yet-started requests the resident bound can
    still take; quotas: `fair_quotas` over the batch's slots.
    """
    if not queue:
        return 0
    preempted = 0
    by_client = Counter(seq.request.client for seq in live)
    paused: Counter[str] = Counter()
    fresh: Counter[str] = Counter()
    for seq in queue:
        (paused if seq.stepped else fresh)[seq.request.client] += 1
    room = math.inf
    if max_resident is not None:
        room = max_resident - len(live) - sum(paused.values())
    demand = {
        client: by_client[client] + paused[client] + int(min(fresh[client], max(0, room)))
        for client in (*by_client, *queue.by_client())
    }
    quotas = fair_quotas(demand, max_batch_size, holding=by_client)
    for client in list(by_client):
        excess = by_client[client] - quotas.get(client, 0)
        if excess <= 0:
            continue
        mine = sorted((s for s in live if s.request.client == client), key=_seq_id)
        for seq in reversed(mine[-excess:]):  # highest ids first; the lowest ends up in front
            live.remove(seq)
            queue.push_front(client, seq)
        by_client[client] -= excess
        preempted += excess

    # a shared KV pool: admit a new request only while every admitted one can still reach
    # its longest (paused ones keep their cells), so no step runs out of cells
    cells, first_waiting = math.inf, math.inf
    if kv_pool_tokens is not None:
        held = [*live, *(s for s in queue if s.stepped)]
        cells = kv_pool_tokens - sum(need(s.request) for s in held)
        # no overtaking: while the oldest new request waits for cells, a later one may not
        # take them (so a large request waits for running ones to end, not for a lull)
        waiting = (s for s in queue if not s.stepped)
        oldest = min(waiting, key=_seq_id, default=None)
        if oldest is not None and need(oldest.request) > cells:
            first_waiting = oldest.seq_id

    def fits(seq: SequenceState) -> bool:
        if seq.stepped:
            return True
        return room > 0 and need(seq.request) <= cells and seq.seq_id <= first_waiting

    def under_quota(client: str, seq: SequenceState) -> bool:
        return by_client[client] < quotas.get(client, 0) and fits(seq)

    def any_client(client: str, seq: SequenceState) -> bool:
        return fits(seq)

    for may_take in (under_quota, any_client):
        while len(live) < max_batch_size:
            taken = queue.pop(1, may_take)
            if not taken:
                break
            seq = taken[0]
            live.append(seq)
            by_client[seq.request.client] += 1
            if not seq.stepped:
                room -= 1
                cells -= need(seq.request)
    return preempted


def _seq_id(seq: SequenceState) -> int:
    return seq.seq_id
