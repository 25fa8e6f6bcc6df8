"""Rows decoding while a long prompt arrives: how long they stall, by `prefill_chunk`.

In process (the Scheduler over SpeculativeStep, the default pair in bf16, every core): 15
requests decode (no drafts, to time prefill alone); after 10 steps a prompt of --prompt tokens
arrives. Per arm: the decoding rows' longest gap between two tokens while it prefills, their
median gap, and the long request's time to first token. Usage:

    .venv/bin/python bench/prefill_chunk/stall.py --chunks 0 128 256 512 --prompt 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

import torch

from avspec.engine.scheduler import Scheduler
from avspec.engine.scheduler_limits import SchedulerLimits
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity

ROOT = Path(__file__).resolve().parents[2]
EOS = 2


def run(step: SpeculativeStep, chunk: int, prompt: int, rows: int) -> dict:
    scheduler = Scheduler(
        step, [EOS], rows + 1, 4096, 8, limits=SchedulerLimits(prefill_chunk=chunk)
    )
    gen = torch.Generator().manual_seed(0)
    stamps: dict[int, list[float]] = {i: [] for i in range(rows + 1)}
    submitted = {}
    lock = threading.Lock()

    def on_step(report, i: int) -> None:
        with lock:
            stamps[i].extend([time.perf_counter()] * max(1, len(report.new_tokens)))

    for i in range(rows):
        ids = torch.randint(100, 40000, (24,), generator=gen).tolist()
        request = GenerationRequest(ids, 60, temperature=0.0, num_draft_tokens=0)
        scheduler.submit(request, lambda r, i=i: on_step(r, i), print)
    long_ids = torch.randint(100, 40000, (prompt,), generator=gen).tolist()
    scheduler.start()
    while min(len(stamps[i]) for i in range(rows)) < 10:
        time.sleep(0.005)
    submitted["t"] = time.perf_counter()
    scheduler.submit(
        GenerationRequest(long_ids, 4, temperature=0.0, num_draft_tokens=0),
        lambda r: on_step(r, rows),
        print,
    )
    while not stamps[rows]:
        time.sleep(0.005)
    first = stamps[rows][0]
    scheduler.stop()
    gaps = [b - a for i in range(rows) for a, b in zip(stamps[i], stamps[i][1:], strict=False)
            if b > submitted["t"] and a < first]  # fmt: skip
    steady = [b - a for i in range(rows) for a, b in zip(stamps[i][:10], stamps[i][1:10],
              strict=False)]  # fmt: skip
    return {
        "prefill_chunk": chunk,
        "longest_gap_ms": round(max(gaps) * 1e3, 1),
        "median_gap_while_prefilling_ms": round(statistics.median(gaps) * 1e3, 1),
        "median_gap_before_ms": round(statistics.median(steady) * 1e3, 1),
        "long_prompt_ttft_ms": round((first - submitted["t"]) * 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chunks", type=int, nargs="+", default=[0, 128, 256, 512])
    parser.add_argument("--prompt", type=int, default=2000)
    parser.add_argument("--rows", type=int, default=15)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    step = SpeculativeStep.from_model_dirs(
        ROOT / "models/target", ROOT / "models/draft", StepCapacity(8, args.rows + 1, 4096),
        dtype=torch.bfloat16,
    )  # fmt: skip
    results = []
    for chunk in args.chunks:
        result = run(step, chunk, args.prompt, args.rows)
        print(json.dumps(result), flush=True)
        results.append(result)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
