"""One target forward per step shape, the fastest of 3 (bf16, 1 thread); run it once per tree:

PYTHONPATH=<tree>/backend .venv/bin/python bench/attention_tiles/shapes.py
"""

import json
import time

import torch

import avspec
from avspec.runtime.precision import load_served_model

torch.set_num_threads(1)
MODEL = load_served_model("models/target", "cpu", "bfloat16", max_length=512)
GEN = torch.Generator().manual_seed(0)
PROMPTS = [40, 60, 300, 80, 120, 45, 70, 90, 150, 55, 65, 200, 85, 75, 50, 100]
SHAPES = {  # rows as (new tokens, cached context)
    "16 decode ctx 150": [(1, 150)] * 16,
    "16 verify 1-3 ctx 150": [(1 + i % 3, 150) for i in range(16)],
    "16 prompts 40-300": [(n, 0) for n in PROMPTS],
    "15 decode + prefill 120": [(1, 150)] * 15 + [(120, 0)],
}


def random_ids(count: int) -> torch.Tensor:
    return torch.randint(0, 40000, (count,), generator=GEN)


def fastest_ms(rows: list[tuple[int, int]], repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache = MODEL.new_cache(len(rows), 512)
        for slot, (_, context) in enumerate(rows):
            cache.allocate(slot)
            if context:
                with torch.inference_mode():
                    MODEL.forward_cached(cache, [slot], random_ids(context), [context])
        lengths = [n for n, _ in rows]
        ids = random_ids(sum(lengths))
        with torch.inference_mode():
            start = time.perf_counter()
            MODEL.forward_cached(cache, list(range(len(rows))), ids, lengths)
            best = min(best, time.perf_counter() - start)
    return round(best * 1e3, 1)


tree = avspec.__file__.split("/")[2]
print(tree, json.dumps({name: fastest_ms(rows) for name, rows in SHAPES.items()}), flush=True)
