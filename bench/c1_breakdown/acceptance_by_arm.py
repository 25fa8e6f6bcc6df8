"""Accepted / verified drafts by arm at concurrency 1, in-process (bf16, the full-vocabulary
draft, a fresh estimator); argument: how many chat prompts (each run twice, 40 tokens).

    .venv/bin/python bench/c1_breakdown/acceptance_by_arm.py 6
"""

import json
import sys
import time
from pathlib import Path

import torch

from avspec.av.cost_file import load_step_cost
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.model_dir import load_tokenizer

torch.set_num_threads(1)
ROOT = Path(__file__).resolve().parents[2]
lines = (ROOT / "workloads" / "chat.jsonl").read_text().splitlines()[: int(sys.argv[1])]
PROMPTS = [json.loads(line)["prompt"] for line in lines]
STEP = SpeculativeStep.from_model_dirs(
    ROOT / "models" / "target", ROOT / "models" / "draft", StepCapacity(8, 4, 1024), "cpu",
    cost=load_step_cost(ROOT / "models" / "cost_tables.json"), dtype=torch.bfloat16,
)  # fmt: skip
TOKENIZER = load_tokenizer(ROOT / "models" / "target")
ARMS = {
    "k2": {"num_draft_tokens": 2, "adaptive": False},
    "ad2": {"num_draft_tokens": 2, "adaptive": True, "adaptive_drafting": True},
    "av2": {"num_draft_tokens": 2, "adaptive": True, "adaptive_drafting": False},
    "ad8": {"num_draft_tokens": 8, "adaptive": True, "adaptive_drafting": True},
}
totals = {arm: {"drafted": 0, "verified": 0, "accepted": 0, "tokens": 0, "s": 0.0} for arm in ARMS}
for round_ in range(2):
    for arm, options in ARMS.items():
        for i, prompt in enumerate(PROMPTS):
            scheduler = Scheduler(STEP, TOKENIZER.eos_ids, 1, 1024, 8)
            reports = []
            request = GenerationRequest(
                TOKENIZER.encode(prompt), 40, temperature=0.7, top_p=0.95,
                random_seed=round_ * 100 + i, **options,
            )  # fmt: skip
            scheduler.submit(request, reports.append, print)
            start = time.perf_counter()
            scheduler.run_until_idle()
            total = totals[arm]
            total["s"] += time.perf_counter() - start
            for key in ("drafted", "verified", "accepted"):
                total[key] += sum(getattr(r, key) for r in reports)
            total["tokens"] += sum(len(r.new_tokens) for r in reports)
    for arm, t in totals.items():
        rate = t["accepted"] / max(t["verified"], 1)
        print(
            f"round {round_} {arm}: drafted {t['drafted']}, verified {t['verified']}, accepted "
            f"{t['accepted']}, accepted/verified {rate:.3f}, {t['tokens']} tokens, "
            f"{t['tokens'] / t['s']:.1f} tok/s",
            flush=True,
        )
