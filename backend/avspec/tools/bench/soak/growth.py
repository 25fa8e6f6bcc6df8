"""Memory growth after the warm-up, and whether it has levelled off.

Growth per process = last sample / first sample after the warm-up - 1. Plateau: the growth over
the first and over the last third (by time) of the post-warm-up samples, each the least-squares
slope x the third's length / its mean level; a process has plateaued when its last-third growth
is under a quarter of its first-third growth or under 1%.
"""

from __future__ import annotations

import numpy as np


def growth_after_warmup(times: list[float], values: list[float], warmup_s: float) -> float | None:
    """last / first value at t >= warmup_s, minus 1; None with fewer than two such samples."""
    post = [v for t, v in zip(times, values, strict=True) if t >= warmup_s]
    if len(post) < 2 or post[0] <= 0:
        return None
    return post[-1] / post[0] - 1


def _third_growth(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope x time span / mean level of `points`; None if under two times."""
    times = np.array([t for t, _ in points])
    values = np.array([v for _, v in points])
    if len(points) < 2 or np.ptp(times) == 0 or values.mean() <= 0:
        return None
    slope = np.polyfit(times, values, 1)[0]
    return float(slope * np.ptp(times) / values.mean())


def plateau(
    times: list[float], values: list[float], warmup_s: float, tolerance: float = 0.01
) -> dict | None:
    """Growth over the first and the last third (by time) of the samples after warm-up.

    A slope per third rather than two single samples: RSS jitters with the allocator.
    plateaued: last-third growth < max(first-third growth / 4, tolerance). None if a third has
    fewer than two samples.
    """
    post = [(t, v) for t, v in zip(times, values, strict=True) if t >= warmup_s]
    if len(post) < 2:
        return None
    t0, t1 = post[0][0], post[-1][0]
    third = (t1 - t0) / 3
    first = [(t, v) for t, v in post if t <= t0 + third]
    last = [(t, v) for t, v in post if t >= t1 - third]
    early, late = _third_growth(first), _third_growth(last)
    if early is None or late is None:
        return None
    return {
        "first_third_growth": round(early, 4),
        "last_third_growth": round(late, 4),
        "plateaued": late < max(early / 4, tolerance),
    }


def memory_report(
    series: dict[str, tuple[list[float], list[float]]], warmup_s: float
) -> dict[str, dict]:
    """Per process: first after warm-up, last, peak, growth and plateau."""
    report = {}
    for name, (times, values) in series.items():
        post = [v for t, v in zip(times, values, strict=True) if t >= warmup_s]
        report[name] = {
            "first_after_warmup_mib": post[0] if post else None,
            "last_mib": values[-1],
            "peak_mib": max(values),
            "growth": growth_after_warmup(times, values, warmup_s),
            "plateau": plateau(times, values, warmup_s),
        }
    return report
