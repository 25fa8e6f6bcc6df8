"""avspec.tools.bench.soak.growth: growth after warm-up, plateau by thirds, the per-process
report.
"""

from __future__ import annotations

import random

import pytest

from avspec.tools.bench.soak.growth import growth_after_warmup, memory_report, plateau


def _times(n: int, step: float = 5.0) -> list[float]:
    return [i * step for i in range(n)]


def test_growth_after_warmup_uses_first_and_last_sample_after_warmup():
    times = _times(6)  # 0 5 10 15 20 25
    values = [100.0, 500.0, 200.0, 210.0, 205.0, 220.0]
    assert growth_after_warmup(times, values, warmup_s=10) == pytest.approx(0.10)
    assert growth_after_warmup(times, values, warmup_s=0) == pytest.approx(1.20)
    assert growth_after_warmup(times, values, warmup_s=25) is None  # one sample left


def test_growth_after_warmup_from_zero_is_none():
    assert growth_after_warmup(_times(3), [0.0, 5.0, 6.0], warmup_s=0) is None


def test_plateau_flat_after_early_growth():
    """Grows 864 -> 1086 over the first third after warm-up, then flat: plateaued."""
    times = _times(31)
    values = [864 + min(t, 50) * 222 / 50 for t in times]
    p = plateau(times, values, warmup_s=0)
    assert p["first_third_growth"] > 0.1
    assert abs(p["last_third_growth"]) < 1e-9
    assert p["plateaued"] is True


def test_plateau_linear_leak_is_not_plateaued():
    times = _times(31)
    values = [800 + 2.0 * t for t in times]  # 2 MiB per second, steady
    p = plateau(times, values, warmup_s=30)
    assert p["last_third_growth"] > 0.25 * p["first_third_growth"] > 0
    assert p["plateaued"] is False


def test_plateau_jitter_within_tolerance_is_plateaued():
    rng = random.Random(0)
    times = _times(40)
    values = [1000 + rng.uniform(-3, 3) for _ in times]
    assert plateau(times, values, warmup_s=0)["plateaued"] is True


def test_plateau_needs_two_samples_per_third():
    assert plateau(_times(3), [1.0, 2.0, 3.0], warmup_s=0) is None
    assert plateau(_times(5), [1.0] * 5, warmup_s=20) is None
    assert plateau(_times(5), [1.0] * 5, warmup_s=100) is None  # nothing after warm-up


def test_memory_report_per_process():
    series = {"tritonserver": (_times(4), [10.0, 20.0, 20.0, 22.0]), "draft": ([0.0], [5.0])}
    report = memory_report(series, warmup_s=5)
    assert report["tritonserver"]["first_after_warmup_mib"] == 20.0
    assert report["tritonserver"]["growth"] == pytest.approx(0.10)
    assert report["tritonserver"]["peak_mib"] == 22.0
    assert report["draft"]["growth"] is None and report["draft"]["first_after_warmup_mib"] is None
