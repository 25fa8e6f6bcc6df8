"""Give freed heap memory back to the OS every few steps (glibc `malloc_trim`).

The stages allocate tensors of a different shape every step (ragged batches), which fragments
glibc's heap; trimming every few steps keeps the stage processes' resident memory flat (why and
what it costs: docs/reliability.md, "Memory under load"). Where the C library has no
`malloc_trim` (not glibc), trimming is off.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


def glibc_malloc_trim() -> Callable[[], object] | None:
    """`malloc_trim(0)` of this process's C library, or None where there is none."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        trim = libc.malloc_trim
    except (OSError, AttributeError, TypeError):
        return None
    return lambda: trim(0)


class HeapTrimmer:
    """Calls `trim` once every `every_steps` calls of `step()`; 0 turns it off."""

    def __init__(self, every_steps: int, trim: Callable[[], object] | None = None) -> None:
        if every_steps < 0:
            raise ValueError(f"malloc_trim_steps must be >= 0, got {every_steps}")
        self.every_steps = every_steps
        self.trim = trim if trim is not None else glibc_malloc_trim()
        if every_steps and self.trim is None:
            logger.warning("no malloc_trim in this C library: heap trimming is off")
        self.steps = 0
        self.trims = 0

    def step(self) -> bool:
        """Count one step; trim when the count reaches a multiple of every_steps."""
        if not self.every_steps or self.trim is None:
            return False
        self.steps += 1
        if self.steps % self.every_steps:
            return False
        self.trim()
        self.trims += 1
        return True
