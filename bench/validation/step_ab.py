"""In-process decode throughput of the default pair (SmolLM2-135M-Instruct and its draft, bf16,
K = 4, AV on, 16 requests x 48 tokens, T 0.7 / top-p 0.95) through the scheduler and
`SpeculativeStep`: the tree on PYTHONPATH is timed, so two trees alternate in one session.

    for r in 1 2; do PYTHONPATH=<old>/backend .venv/bin/python bench/validation/step_ab.py old
                     PYTHONPATH=backend .venv/bin/python bench/validation/step_ab.py new; done
"""

import sys
import time
from pathlib import Path

import torch

from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity

ROOT = Path(__file__).resolve().parents[2]
torch.set_num_threads(2)
step = SpeculativeStep.from_model_dirs(
    ROOT / "models/target", ROOT / "models/draft", StepCapacity(4, 16, 256), dtype=torch.bfloat16
)
scheduler = Scheduler(step, {2}, 16, 256, 4)
tokens = [0]
for i in range(16):
    request = GenerationRequest(
        [1, 9690, 198, 2683, 314, 253, 1345 + 7 * i, 30], 48, temperature=0.7, top_p=0.95,
        random_seed=i, num_draft_tokens=4, adaptive=True,
    )  # fmt: skip
    scheduler.submit(request, lambda r: tokens.__setitem__(0, tokens[0] + len(r.new_tokens)),
                     lambda e: print("error", e))  # fmt: skip
started = time.perf_counter()
steps = 0
while scheduler.step():
    steps += 1
elapsed = time.perf_counter() - started
print(f"{sys.argv[1]}: {tokens[0]} tokens in {elapsed:.2f} s, {steps} steps: "
      f"{tokens[0] / elapsed:.1f} tokens/s")  # fmt: skip
