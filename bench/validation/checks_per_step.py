"""Count the validation calls one in-process speculative step runs (issue: validation once).

Drives the scheduler over `SpeculativeStep` (tiny random float64 pair, 8 requests, adaptive
verification on, K = 4) and counts, per decode step, calls of the shared checks
(`avspec.checks`), the stages' input readers and every function whose name says it validates.

    PYTHONPATH=backend .venv/bin/python bench/validation/checks_per_step.py
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from helpers.stages import K, perturbed, tiny_model  # noqa: E402

from avspec.engine.scheduler import Scheduler  # noqa: E402
from avspec.engine.sequence import GenerationRequest  # noqa: E402
from avspec.engine.step import SpeculativeStep, StepCapacity  # noqa: E402

NAMES = ("check_", "_check", "_validate", "validate", "read_step_inputs")


def main() -> None:
    target = tiny_model(20, layers=2, width=32)
    step = SpeculativeStep.from_models(
        target, perturbed(target, 0.3, seed=5), StepCapacity(K, 8, 96)
    )
    scheduler = Scheduler(step, {10**6}, 8, 96, K)
    for i in range(8):
        request = GenerationRequest(
            [3 + i, 17, 40], 24, temperature=1.0, top_p=0.9, random_seed=i,
            num_draft_tokens=K, adaptive=True,
        )  # fmt: skip
        scheduler.submit(request, lambda r: None, lambda e: None)
    counts: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):  # noqa: ANN001, ANN202
        if event == "call" and "avspec" in frame.f_code.co_filename:
            name = frame.f_code.co_name
            if name.startswith(NAMES) or name in NAMES:
                counts[f"{Path(frame.f_code.co_filename).stem}.{name}"] += 1

    steps = 0
    sys.setprofile(profile)
    try:
        while steps < 12 and scheduler.step():
            steps += 1
    finally:
        sys.setprofile(None)
    total = sum(counts.values())
    print(f"{steps} steps, 8 rows, K = {K}: {total / steps:.1f} validation calls per step")
    for name, n in counts.most_common():
        print(f"  {n / steps:6.1f}  {name}")


if __name__ == "__main__":
    main()
