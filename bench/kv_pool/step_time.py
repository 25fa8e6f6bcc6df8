"""Median ms of one target forward_cached (SmolLM2-135M, bf16, 1 thread) per rows x new tokens
@ cached positions, 12 calls (first 2 dropped). PYTHONPATH picks the backend/ timed; argv[1]
labels it.

Before/after the block pool (issue 32, item 4), alternated in one session:
    git worktree add /tmp/oldtree <before>
    for r in 1 2; do PYTHONPATH=/tmp/oldtree/backend .venv/bin/python bench/kv_pool/step_time.py old
                     PYTHONPATH=backend .venv/bin/python bench/kv_pool/step_time.py new; done
"""

import statistics
import sys
import time
from pathlib import Path

import torch

from avspec.runtime.precision import load_served_model

torch.set_num_threads(1)
model = load_served_model(
    str(Path(__file__).resolve().parents[2] / "models/target"), "cpu", "bfloat16", max_length=512
)
out = {}
for rows, toks, ctx in [(1, 1, 80), (16, 1, 80), (64, 1, 80), (64, 9, 80), (16, 1, 400)]:
    cache = model.new_cache(64, 512, "cpu")
    with torch.no_grad():
        ids = list(range(rows))
        for i in ids:
            cache.allocate(i)
        model.forward_cached(cache, ids, torch.randint(0, 1000, (rows * ctx,)), [ctx] * rows)
        times = []
        for _ in range(12):
            x = torch.randint(0, 1000, (rows * toks,))
            t = time.perf_counter()
            model.forward_cached(cache, ids, x, [toks] * rows)
            times.append((time.perf_counter() - t) * 1e3)
            for i in ids:
                cache.rollback(i, ctx)
    out[f"{rows}x{toks}@{ctx}"] = round(statistics.median(times[2:]), 2)
print(sys.argv[1], out, flush=True)
