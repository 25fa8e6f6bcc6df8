"""Fair share of the batch through the real in-process stages (draft -> verifier -> target).

- A paused sequence continues exactly: the stages keep its KV cache and generators while the
  scheduler leaves it out of the steps, so with adaptive verification off (the setting in which
  a sequence's tokens do not depend on its batch) its seeded, sampled output is identical to an
  unpaused run's.
- `measure`: one client holds every slot with long streams, another client sends a short
  request; how many steps and how long until its first token and its last. Also a script:

      PYTHONPATH=tests .venv/bin/python tests/unit/engine/test_fair_share.py [--batch 64]

  (`--scheduler FILE`: measure a Scheduler class loaded from FILE instead, e.g. an older
  avspec/engine/scheduler.py, for a before/after comparison).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from helpers.stages import K, perturbed, tiny_model

from avspec.engine.scheduler import Scheduler
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import GenerationRequest, StepReport
from avspec.engine.step import SpeculativeStep, StepCapacity

pytestmark = pytest.mark.usefixtures("single_thread")

NO_EOS = 1 << 20  # an id no model here emits: every stream runs to max_tokens
MAX_LENGTH = 96  # the tiny models' context


def make_step(max_sequences: int) -> SpeculativeStep:
    target = tiny_model(20, layers=2, width=32)
    return SpeculativeStep.from_models(
        target, perturbed(target, 0.3, seed=5), StepCapacity(K, max_sequences, MAX_LENGTH)
    )


def sampled(prompt: list[int], max_tokens: int, seed: int, client: str) -> GenerationRequest:
    """A sampled request (T = 1, top-p 0.9) with AV off: its tokens depend on its seed only."""
    return GenerationRequest(
        prompt, max_tokens, temperature=1.0, top_p=0.9, random_seed=seed, num_draft_tokens=K,
        adaptive=False, client=client,
    )  # fmt: skip


def test_a_paused_sequence_continues_exactly() -> None:
    prompts = [[72, 101, 108], [1] * 9, [200, 3, 17, 99, 5, 6], [42]]
    hog = [sampled(p, 40, seed=11 + i, client="A") for i, p in enumerate(prompts)]
    outputs = []
    for other_client in (False, True):
        scheduler = Scheduler(
            make_step(8), NO_EOS, 4, MAX_LENGTH, K, limits=SchedulerLimits(max_resident=8)
        )
        tokens: list[list[int]] = [[] for _ in hog]
        for request, out in zip(hog, tokens, strict=True):
            scheduler.submit(request, lambda r, out=out: out.extend(r.new_tokens), pytest.fail)
        for _ in range(3):
            scheduler.step()
        if other_client:  # two short requests of B pause A's two latest for a few steps
            for seed in (1, 2):
                scheduler.submit(sampled([7, 7], 12, seed, "B"), lambda r: None, pytest.fail)
            scheduler.step()
            assert scheduler.counters.preemptions == 2 and scheduler.paused_count == 2
        scheduler.run_until_idle()
        assert scheduler.paused_count == 0
        outputs.append(tokens)
    assert all(len(t) == 40 for t in outputs[0])
    assert outputs[1] == outputs[0]


@dataclass
class Measurement:
    """What `measure` saw; times in ms, steps counted from the other client's submission."""

    batch: int
    step_ms: float  # median step time while the hog's streams and the other request run
    first_token_steps: int
    first_token_ms: float
    finish_steps: int
    finish_ms: float
    hog_live_at_finish: int  # the hog's streams still running when the other request finished


def measure(
    batch: int = 64,
    hog_tokens: int = 80,
    other_tokens: int = 8,
    warmup_steps: int = 5,
    scheduler_cls: type = Scheduler,
) -> Measurement:
    """One client ("hog") fills all `batch` slots with `hog_tokens`-token streams; after
    `warmup_steps` steps another client sends an `other_tokens`-token request. Steps by hand,
    timing each, until that request finishes."""
    step = make_step(2 * batch)
    scheduler = scheduler_cls(step, NO_EOS, batch, MAX_LENGTH, K)
    hog_done: list[bool] = []
    for i in range(batch):
        hog_done.append(False)

        def on_hog(report: StepReport, i: int = i) -> None:
            hog_done[i] = report.finished

        request = sampled([3 + i % 50, 5, 8, 13], hog_tokens, seed=i, client="hog")
        scheduler.submit(request, on_hog, pytest.fail)
    for _ in range(warmup_steps):
        scheduler.step()
    seen: list[tuple[int, float]] = []  # (step count, ms) at each report with tokens
    finished: list[tuple[int, float]] = []
    steps = [0]
    started = time.perf_counter()

    def on_other(report: StepReport) -> None:
        ms = (time.perf_counter() - started) * 1e3
        if report.new_tokens:
            seen.append((steps[0], ms))
        if report.finished:
            finished.append((steps[0], ms))

    scheduler.submit(sampled([9, 9, 9], other_tokens, 99, "other"), on_other, pytest.fail)
    step_ms = []
    while not finished:
        steps[0] += 1  # the step now running
        before = time.perf_counter()
        scheduler.step()
        step_ms.append((time.perf_counter() - before) * 1e3)
    return Measurement(
        batch, statistics.median(step_ms), seen[0][0], seen[0][1], finished[0][0],
        finished[0][1], hog_done.count(False),
    )  # fmt: skip


def test_another_client_is_served_within_two_steps_while_the_hog_runs() -> None:
    result = measure(batch=8, hog_tokens=60, other_tokens=8)
    assert result.first_token_steps == 1  # admitted at the first boundary, first token then
    assert result.finish_steps <= 8  # at least one token per step
    assert result.hog_live_at_finish == 8  # paused or running, none of the hog's finished


def _load_scheduler(path: Path) -> type:
    spec = importlib.util.spec_from_file_location("measured_scheduler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module.Scheduler


def main() -> None:
    parser = argparse.ArgumentParser(description=measure.__doc__)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--hog-tokens", type=int, default=80)
    parser.add_argument("--other-tokens", type=int, default=8)
    parser.add_argument("--scheduler", type=Path, help="file defining the Scheduler to measure")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cls = _load_scheduler(args.scheduler) if args.scheduler else Scheduler
    with torch.no_grad():
        result = measure(args.batch, args.hog_tokens, args.other_tokens, scheduler_cls=cls)
    print(result)
    print(
        f"other client: first token after {result.first_token_steps} step(s), "
        f"{result.first_token_ms:.0f} ms = {result.first_token_ms / result.step_ms:.1f} step "
        f"times (median step {result.step_ms:.1f} ms); finished after {result.finish_steps} "
        f"steps, {result.finish_ms:.0f} ms; {result.hog_live_at_finish} of the hog's "
        f"{result.batch} streams still running"
    )


if __name__ == "__main__":
    main()
