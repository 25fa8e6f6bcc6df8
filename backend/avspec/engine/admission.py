"""Admission: per-client FIFO wait queues, admitted round robin, with a bounded length.

The scheduler (avspec.engine.scheduler) holds one `AdmissionQueue` for the requests that wait for
a batch slot and takes from it at each step boundary.

- Admission control: `add` raises `Overloaded` (nothing enqueued) when the queue already holds
  `max_queued` requests, or the request's client `max_queued_per_client`, beyond the batch's free
  slots (requests the next step boundary will admit anyway do not count). The limits are checked
  when a request is added; None means unbounded.
- Fairness: `pop` takes one request per client in turn (round robin over the clients with queued
  work, each client's own requests FIFO; the anonymous client "" is one client). A request at the
  head of its client's queue is admitted within C admissions, C = the clients with queued work at
  that moment (clients arriving later queue behind it), so a burst from one client cannot starve
  another.
- Fair share of the batch (`fair_quotas`): at each step boundary the batch's slots are split
  max-min fairly over the clients with live or queued work, by demand (live + queued). When a
  client waits, no client keeps more than its quota: the scheduler pauses the excess (a paused
  sequence goes back to the front of its client's queue, `push_front`) and admits by quota
  (`pop` with `may_take`). Quotas sum to min(slots, total demand), so a client with queued work
  gets at least min(its demand, floor(slots / C)) slots, C = the clients with work.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


class Overloaded(RuntimeError):
    """The wait queue is full for this request; the message says which limit and to retry."""


class AdmissionQueue(Generic[T]):
    """Waiting requests per client, taken round robin; not thread-safe (the caller locks)."""

    def __init__(
        self, max_queued: int | None = None, max_queued_per_client: int | None = None
    ) -> None:
        limits = {"max_queued": max_queued, "max_queued_per_client": max_queued_per_client}
        for name, limit in limits.items():
            if limit is not None and limit < 1:
                raise ValueError(f"{name} must be >= 1 or None, got {limit}")
        self.max_queued = max_queued
        self.max_queued_per_client = max_queued_per_client
        # client -> its queued requests (FIFO); key order is the round-robin order
        self._queues: OrderedDict[str, deque[T]] = OrderedDict()

    def __len__(self) -> int:
        """Requests waiting, all clients together."""
        return sum(len(queue) for queue in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._queues)

    def __iter__(self) -> Iterator[T]:
        """Every waiting request, client by client in round-robin order."""
        return (item for queue in self._queues.values() for item in queue)

    def by_client(self) -> dict[str, int]:
        """Waiting requests per client (clients with none are absent)."""
        return {client: len(queue) for client, queue in self._queues.items()}

    def add(self, client: str, item: T, free_slots: int) -> None:
        """Queue `item` behind `client`'s earlier requests.

        Raises Overloaded, queueing nothing, if a limit is reached; `free_slots` (the batch's
        free slots, admitted at the next step boundary anyway) count as room.
        """
        free = max(0, free_slots)
        for limit, queued, whose in (
            (self.max_queued, len(self), ""),
            (self.max_queued_per_client, len(self._queues.get(client, ())), " for this client"),
        ):
            if limit is not None and queued - free >= limit:
                raise Overloaded(
                    f"overloaded: {queued - free} requests queued{whose} (limit {limit}); "
                    "retry later"
                )
        self._queues.setdefault(client, deque()).append(item)

    def remove(self, client: str, item: T) -> bool:
        """Take `item` out of `client`'s queue; False if it is not waiting there."""
        queue = self._queues.get(client)
        if queue is None or item not in queue:
            return False
        queue.remove(item)
        if not queue:
            del self._queues[client]
        return True

    def push_front(self, client: str, item: T) -> None:
        """Put `item` back at the head of `client`'s queue (a paused sequence: no limit applies,
        it was admitted once); the client keeps its place in the rotation, or joins at its end."""
        self._queues.setdefault(client, deque()).appendleft(item)

    def pop(self, count: int, may_take: Callable[[str, T], bool] | None = None) -> list[T]:
        """Up to `count` requests in admission order: one per client in turn.

        `may_take(client, head)`: take a client's head only when it says so; a client passed
        over keeps its place at the front of the rotation.
        """
        taken: list[T] = []
        while len(taken) < count:
            progressed = False
            for client in list(self._queues):
                if len(taken) == count:
                    break
                queue = self._queues[client]
                if may_take is not None and not may_take(client, queue[0]):
                    continue
                taken.append(queue.popleft())
                progressed = True
                del self._queues[client]
                if queue:
                    self._queues[client] = queue  # to the back of the rotation
            if not progressed:
                break
        return taken


def fair_quotas(
    demand: Mapping[str, int], slots: int, holding: Mapping[str, int] | None = None
) -> dict[str, int]:
    """Max-min fair split of `slots` over the clients of `demand` (client -> slots it could use).

    Water filling: a client wanting no more than an equal share of what is left gets all it
    wants; the others share the rest equally, and the remainder of that division goes one slot
    each to those `holding` the most slots now (ties: `demand` order), so rounding never pauses
    a sequence. Quotas sum to min(slots, sum of demand); clients with no demand get none.
    """
    if slots < 0:
        raise ValueError(f"slots must be >= 0, got {slots}")
    holding = holding or {}
    quotas = {client: 0 for client, want in demand.items() if want > 0}
    left = slots
    open_ = sorted(quotas, key=lambda c: demand[c])  # stable: ties keep demand order
    while open_:
        share = left // len(open_)
        small = [c for c in open_ if demand[c] <= share]
        if not small:
            break
        for client in small:
            quotas[client] = demand[client]
            left -= demand[client]
        open_ = [c for c in open_ if demand[c] > share]
    if open_:
        share, extra = divmod(left, len(open_))
        order = sorted(open_, key=lambda c: -holding.get(c, 0))
        for i, client in enumerate(order):
            quotas[client] = share + (i < extra)
    return quotas
