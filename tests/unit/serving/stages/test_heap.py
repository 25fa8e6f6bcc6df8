"""HeapTrimmer: trims every N steps, never when off; the glibc hooks are found here, and a
stage's own mmap threshold takes effect."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from avspec.serving.stages.heap import HeapTrimmer, glibc_malloc_trim, set_mmap_threshold


def test_trims_once_every_n_steps() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(3, trim=lambda: calls.append(1))
    done = [trimmer.step() for _ in range(7)]
    assert done == [False, False, True, False, False, True, False]
    assert len(calls) == trimmer.trims == 2


def test_zero_turns_it_off() -> None:
    calls: list[int] = []
    trimmer = HeapTrimmer(0, trim=lambda: calls.append(1))
    assert not any(trimmer.step() for _ in range(20)) and not calls


def test_negative_is_refused() -> None:
    with pytest.raises(ValueError, match="malloc_trim_steps"):
        HeapTrimmer(-1)


def test_glibc_hook_runs_here() -> None:
    trim = glibc_malloc_trim()
    assert trim is not None, "this project's machines run glibc"
    trim()  # returns 0 or 1; must not raise


# A child that allocates and frees an 8 MiB buffer 20 times and prints its minor page faults.
FAULTS = """
import resource, sys
import numpy as np
from avspec.serving.stages.heap import set_mmap_threshold
print(set_mmap_threshold(int(sys.argv[1])))
np.ones(1 << 21, dtype=np.float32)  # a first one, to grow the heap
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    np.ones(1 << 21, dtype=np.float32)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def faults_with_threshold(mib: int) -> tuple[str, int]:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}  # as the launcher sets it
    out = subprocess.run(
        [sys.executable, "-c", FAULTS, str(mib)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return out[0], int(out[1])


def test_a_raised_mmap_threshold_stops_the_per_step_faults() -> None:
    """Under the environment's 1 MiB threshold each 8 MiB buffer is mapped anew and faulted in
    (measured: about 500 faults each, with transparent huge pages); at 32 MiB it is reused from
    the heap (measured: none)."""
    kept, faults_kept = faults_with_threshold(0)
    raised, faults_raised = faults_with_threshold(32)
    assert (kept, raised) == ("False", "True")
    assert faults_kept > 20 * 100, faults_kept
    assert faults_raised < faults_kept / 10, (faults_raised, faults_kept)


def test_a_negative_mmap_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="malloc_mmap_mib"):
        set_mmap_threshold(-1)
