"""The forwarded inference calls in progress, so that `Front.abort_inference` can end them.

When the entry model's stub dies, Triton 2.51 never answers its in-flight decoupled requests:
their streams would hang until the client gives up. Each relay registers every inference call it
forwards with an `abort(message)` callback; `abort_all` ends the calls registered at that moment,
and calls that start afterwards are not affected. Everything here runs on the front's event loop
(Front.abort_inference brings the call over from other threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Iterator

_log = logging.getLogger(__name__)

Abort = Callable[[str], None]


class InFlight:
    """The registered calls: id -> abort callback (synchronous, called at most once)."""

    def __init__(self) -> None:
        self._calls: dict[int, Abort] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        return len(self._calls)

    @contextlib.contextmanager
    def track(self, abort: Abort) -> Iterator[None]:
        """Register a call for as long as the block runs."""
        call_id = next(self._ids)
        self._calls[call_id] = abort
        try:
            yield
        finally:
            self._calls.pop(call_id, None)

    def abort_all(self, message: str) -> int:
        """End every registered call with `message`; return how many there were."""
        calls = list(self._calls.values())
        self._calls.clear()
        for abort in calls:
            try:
                abort(message)
            except Exception:  # one call's trouble must not spare the others
                _log.exception("front: aborting an in-flight call failed")
        return len(calls)


def settle(future: asyncio.Future[str], message: str) -> None:
    """An abort callback that resolves `future` with the message (once)."""
    if not future.done():
        future.set_result(message)


class Abortable:
    """The current task, registered so that `InFlight.abort_all` cancels it with a message.

    Cheaper than racing a second task against an abort future (one task per call, nothing to
    wait on twice): the abort cancels the task; the call catches CancelledError and asks
    `resume()` whether the abort was the reason, then answers with `message`.
    """

    def __init__(self) -> None:
        self.message: str | None = None
        self._task = asyncio.current_task()

    def abort(self, message: str) -> None:
        if self.message is None and self._task is not None:
            self.message = message
            self._task.cancel()

    def resume(self) -> bool:
        """After a CancelledError: True if only the abort cancelled the task (now undone)."""
        if self.message is None or self._task is None:
            return False
        return self._task.uncancel() == 0


@contextlib.contextmanager
def abortable(inflight: InFlight) -> Iterator[Abortable]:
    """Register the current task for as long as the block runs (see Abortable)."""
    call = Abortable()
    with inflight.track(call.abort):
        yield call
