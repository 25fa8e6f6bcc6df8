"""The stage processes' glibc heap: trimmed every few steps, and its mmap threshold per stage.

The stages allocate tensors of a different shape every step (ragged batches), which fragments
glibc's heap; trimming every few steps keeps the stage processes' resident memory flat (why and
what it costs: docs/reliability.md, "Memory under load"). Where the C library has no
`malloc_trim` (not glibc), trimming is off.

The server's environment fixes glibc's mmap threshold at 1 MiB for every process
(avspec.serving.host.triton_env), which keeps memory flat but makes a stage map and unmap its
large per-step tensors, page-faulting them in every step. `set_mmap_threshold` raises it for one
process (`mallopt`), for a stage whose memory stays flat without it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)


# mallopt's parameter numbers (glibc malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# the trim threshold set with a raised mmap threshold, as a multiple of it: free() then gives
# the heap's top back only past this, so a step's tensors are not unmapped and faulted again
TRIM_PER_MMAP = 8


def libc() -> ctypes.CDLL | None:
    """This process's C library, or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except (OSError, TypeError):
        return None


def glibc_malloc_trim() -> Callable[[], object] | None:
    """`malloc_trim(0)` of this process's C library, or None where there is none."""
    lib = libc()
    trim = getattr(lib, "malloc_trim", None)
    if trim is None:
        return None
    return lambda: trim(0)


def set_mmap_threshold(mib: int) -> bool:
    """Fix this process's glibc mmap threshold at `mib` MiB and its trim threshold at
    TRIM_PER_MMAP times that; 0 leaves both as the environment set them. Returns whether
    they were set (False also where the C library has no `mallopt`, with a warning)."""
    if mib < 0:
        raise ValueError(f"malloc_mmap_mib must be >= 0 (0: the environment's), got {mib}")
    if not mib:
        return False
    mallopt = getattr(libc(), "mallopt", None)
    threshold = mib << 20
    if mallopt is None or not mallopt(M_MMAP_THRESHOLD, threshold):
        logger.warning("mallopt refused an mmap threshold of %d MiB: left as it was", mib)
        return False
    mallopt(M_TRIM_THRESHOLD, TRIM_PER_MMAP * threshold)
    return True


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
