"""Uniform steps (one tile before and after), 7 samples after a warm-up: (fastest, median) ms.

PYTHONPATH=<tree>/backend .venv/bin/python bench/attention_tiles/shapes_uniform.py
"""

import json
import statistics
import time

import torch

import avspec
from avspec.runtime.precision import load_served_model

torch.set_num_threads(1)
MODEL = load_served_model("models/target", "cpu", "bfloat16", max_length=512)
GEN = torch.Generator().manual_seed(0)


def samples_ms(rows: list[tuple[int, int]], repeats: int = 7) -> tuple[float, float]:
    cache = MODEL.new_cache(len(rows), 512)
    for slot, (_, context) in enumerate(rows):
        cache.allocate(slot)
        with torch.inference_mode():
            ids = torch.randint(0, 40000, (context,), generator=GEN)
            MODEL.forward_cached(cache, [slot], ids, [context])
    lengths = [n for n, _ in rows]
    times = []
    for _ in range(repeats):
        ids = torch.randint(0, 40000, (sum(lengths),), generator=GEN)
        with torch.inference_mode():
            start = time.perf_counter()
            MODEL.forward_cached(cache, list(range(len(rows))), ids, lengths)
            times.append(time.perf_counter() - start)
        for slot, (_, context) in enumerate(rows):
            cache.rollback(slot, context)
    return round(min(times) * 1e3, 1), round(statistics.median(times) * 1e3, 1)


samples_ms([(1, 150)] * 16, repeats=3)  # warm-up
shapes = {
    "16 decode ctx 150": [(1, 150)] * 16,
    "1 decode": [(1, 150)],
    "16 verify 3": [(3, 150)] * 16,
}
tree = avspec.__file__.split("/")[2]
print(tree, json.dumps({name: samples_ms(rows) for name, rows in shapes.items()}), flush=True)
