"""Stopping a server's process group for good, whatever signals arrive meanwhile.

tritonserver runs in a process group of its own with its stubs. A stop sends SIGTERM, waits for a
graceful exit, and always ends with SIGKILL to the whole group (the stubs too). `make` forwards
SIGTERM twice, 50 ms apart: a signal handler that raised in the middle of a stop would abandon it
half-way, leaving the server serving. So while a stop runs in the main thread, SIGINT/SIGTERM are
held: the first is noted, the next kills the group at once (ending the wait).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Callable, Iterator


def kill_group(pgid: int) -> None:
    """SIGKILL to every process of group `pgid` (gone already: nothing to do)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _say(text: str) -> None:
    # os.write, not print: a handler may run in the middle of a print to stderr
    with contextlib.suppress(OSError):
        os.write(2, f"avspec: {text}\n".encode())


@contextlib.contextmanager
def signals_held(kill: Callable[[], None]) -> Iterator[None]:
    """Hold SIGINT/SIGTERM for the block: the first is noted, every later one calls `kill`.

    Outside the main thread no handler can run anyway, and nothing is installed. The previous
    handlers come back afterwards.
    """
    noted: list[str] = []

    def note(signum: int, frame: object) -> None:
        noted.append(signal.Signals(signum).name)
        if len(noted) == 1:
            _say(f"{noted[-1]} while stopping: noted; one more kills the server at once")
        else:
            _say(f"{noted[-1]} while stopping: killing the server's process group")
            kill()

    previous = {}
    with contextlib.suppress(ValueError):  # not the main thread
        for signum in (signal.SIGINT, signal.SIGTERM):
            previous[signum] = signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def terminate(process: subprocess.Popen, grace_s: float) -> int | None:
    """SIGTERM if still running, then wait up to `grace_s`; the exit code, or None if it did
    not exit in time (the caller kills the group then)."""
    code = process.poll()
    if code is None:
        process.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = process.wait(timeout=grace_s)
    return code
