"""HeapTrimmer: trims every N steps, never when off; the glibc hook is found here."""

from __future__ import annotations

import pytest

from avspec.serving.stages.heap import HeapTrimmer, glibc_malloc_trim


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
