#!/usr/bin/env python3
"""Time of the estimator quality metrics (avspec.av.calibration) on millions of labels.

The goal, from the module's docstring: millions of labels take well under a second per metric.
Times AUC, log-loss, ECE and the whole calibration_report (4 draft positions) on --labels random
labels (p ~ U(0, 1), y ~ Bernoulli(p)), the median of --repeats runs each, on the host. It asserts
nothing (timings on shared machines are noisy); it prints a table and, with --json, writes it.
Correctness at this size is a test: tests/unit/av/test_calibration.py.

    .venv/bin/python client/bench_calibration.py --json bench/calibration_timing.json

Recorded result: bench/calibration_timing.json (2M labels, 5 repeats).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from avspec.av.calibration import auc, calibration_report, ece, log_loss


def median_s(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench(labels: int, repeats: int, seed: int = 6) -> dict:
    rng = np.random.default_rng(seed)
    p = rng.random(labels)
    y = (rng.random(labels) < p).astype(np.float64)
    positions = np.arange(labels) % 4
    calls = {
        "auc": lambda: auc(p, y),
        "log_loss": lambda: log_loss(p, y),
        "ece": lambda: ece(p, y),
        "calibration_report": lambda: calibration_report(p, y, positions),
    }
    return {
        "labels": labels,
        "repeats": repeats,
        "machine": f"{platform.machine()} x {os.cpu_count()} cpus, python "
        f"{platform.python_version()}, numpy {np.__version__}",
        "median_s": {name: median_s(call, repeats) for name, call in calls.items()},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", type=int, default=2_000_000, help="labels per call")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per metric")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    result = bench(args.labels, args.repeats)
    print(f"{args.labels} labels, median of {args.repeats}:")
    for name, seconds in result["median_s"].items():
        print(f"  {name:<20} {seconds:8.3f} s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
