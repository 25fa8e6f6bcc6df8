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
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterator
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

    def pop(self, count: int) -> list[T]:
        """Up to `count` requests in admission order: one per client in turn."""
        taken: list[T] = []
        while self._queues and len(taken) < count:
            client, queue = next(iter(self._queues.items()))
            taken.append(queue.popleft())
            del self._queues[client]
            if queue:
                self._queues[client] = queue  # to the back of the rotation
        return taken
