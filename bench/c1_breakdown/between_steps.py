"""Does the work between two target steps slow the next one? One bf16 token at context 150,
15 calls per kind, with nothing, the draft's passes, a 64 MB write, or both in between.

    .venv/bin/python bench/c1_breakdown/between_steps.py
"""

import statistics
import time

import torch

from avspec.runtime.precision import load_served_model

torch.set_num_threads(1)
TARGET = load_served_model("models/target", "cpu", "bfloat16", max_length=512)
DRAFT = load_served_model("models/draft", "cpu", "bfloat16", max_length=512)
TARGET_CACHE, DRAFT_CACHE = TARGET.new_cache(1, 512), DRAFT.new_cache(1, 512)
CONTEXT = 150
JUNK = torch.empty(64 * 2**20 // 4)  # what the other stages and the hand-overs touch


def setup() -> None:
    ids = torch.randint(0, 40000, (CONTEXT,))
    for model, cache in ((TARGET, TARGET_CACHE), (DRAFT, DRAFT_CACHE)):
        cache.allocate(0)
        with torch.inference_mode():
            model.forward_cached(cache, [0], ids, [CONTEXT])


def target_step_ms() -> float:
    with torch.inference_mode():
        start = time.perf_counter()
        TARGET.forward_cached(TARGET_CACHE, [0], torch.tensor([5]), [1])
        elapsed = time.perf_counter() - start
    TARGET_CACHE.rollback(0, CONTEXT)
    return elapsed * 1e3


def between(kind: str) -> None:
    with torch.inference_mode():
        if kind in ("draft", "both"):
            for _ in range(3):
                DRAFT.forward_cached(DRAFT_CACHE, [0], torch.tensor([5]), [1])
            DRAFT_CACHE.rollback(0, CONTEXT)
        if kind in ("junk", "both"):
            JUNK.fill_(1.0)


setup()
for round_ in range(2):
    for kind in ("none", "draft", "junk", "both"):
        times = []
        for _ in range(15):
            between(kind)
            times.append(target_step_ms())
        median, fastest = statistics.median(times), min(times)
        print(f"{round_} {kind} median {median:.1f} min {fastest:.1f}", flush=True)
