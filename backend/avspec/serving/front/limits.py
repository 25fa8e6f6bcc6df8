"""Caps on what one IP address, and every client together, may hold open at the front.

One attacker opens many connections from one address: 1,024 gRPC `ModelStreamInfer` calls that
never sent a message once filled the gRPC server's `maximum_concurrent_rpcs`, and from then on
every new call, `ServerLive` included, got RESOURCE_EXHAUSTED. So the relays count here, in their
own handlers: each IP address holds at most `per_address` slots (HTTP connections; gRPC
streams) and all clients together at most `total` (HTTP connections; gRPC calls). Health calls
take no slot, so no cap ever refuses them. The identity is the IP address alone: ports change
with every connection, and an attacker has as many as it likes.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator


class Full(Exception):
    """No slot is free; the message names the cap and says to retry.

    per_address: the caller's own address reached its cap (over HTTP 429: this client sends
    too much), rather than every client together (503: the server is full).
    """

    def __init__(self, message: str, per_address: bool) -> None:
        super().__init__(message)
        self.per_address = per_address


class Slots:
    """Slots held per IP address and in total; single-threaded (the front's event loop)."""

    def __init__(self, per_address: int, total: int, *, noun: str, total_noun: str) -> None:
        self.per_address = per_address
        self.total = total
        self._noun = noun  # what one address holds, e.g. "open connections"
        self._total_noun = total_noun  # what the total counts, e.g. "calls in progress"
        self._held: Counter[str] = Counter()
        self._count = 0

    def __len__(self) -> int:
        """Slots held, every address together."""
        return self._count

    def held(self, address: str) -> int:
        """Slots `address` holds (those that count against its cap)."""
        return self._held[address]

    @contextlib.contextmanager
    def hold(self, address: str | None) -> Iterator[None]:
        """Hold one slot for as long as the block runs; raise Full before it if none is free.

        address None takes a slot of the total only (a short call that no address may hold
        many of for long, e.g. a gRPC unary call).
        """
        if address is not None and self._held[address] >= self.per_address:
            message = (
                f"too many {self._noun} from {address} (limit {self.per_address} per address); "
                "close some or retry later"
            )
            raise Full(message, per_address=True)
        if self._count >= self.total:
            limit = self.total
            message = f"too many {self._total_noun} at this server (limit {limit}); retry later"
            raise Full(message, per_address=False)
        self._count += 1
        if address is not None:
            self._held[address] += 1
        try:
            yield
        finally:
            self._count -= 1
            if address is not None:
                self._held[address] -= 1
                if not self._held[address]:
                    del self._held[address]
