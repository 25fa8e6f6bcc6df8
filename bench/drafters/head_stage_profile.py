"""Where the head's draft stage spends a step, in process (no Triton), one thread, bf16.

    .venv/bin/python bench/drafters/head_stage_profile.py > bench/drafters/head_stage_profile.txt

The served pair (models/target + models/head, the head's draft vocabulary) decodes the first
`rows` prompts of workloads/chat.jsonl together, 48 tokens each, temperature 0.7 / top-p 0.95,
4 drafts a step (adaptive verification off), once to warm up and once measured. Per step: the
stage's wall time and its passes (`DraftOutput.pass_ms`). Then the parts of one pass at the same
rows, timed alone: the head's fc, its block over the cache, the output layer over the kept ids,
the warp (temperature and top-p) of those logits.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))  # helpers.generation: run requests to completion

from helpers.generation import generate  # noqa: E402

from avspec.engine.draft_vocab import DRAFT_VOCAB_AUTO, resolve_draft_vocab  # noqa: E402
from avspec.engine.head_stage import HeadDraftStage  # noqa: E402
from avspec.engine.sampling import warp_probs  # noqa: E402
from avspec.engine.scheduler import Scheduler  # noqa: E402
from avspec.engine.sequence import GenerationRequest  # noqa: E402
from avspec.engine.step import SpeculativeStep, StepCapacity  # noqa: E402
from avspec.runtime.head import load_head_dir  # noqa: E402
from avspec.runtime.model_dir import load_model, load_tokenizer  # noqa: E402
from avspec.tools.train.head.drafter import final_features  # noqa: E402

CONTEXT, ROWS = 1024, (1, 64)


class TimedStage(HeadDraftStage):
    """The served head stage, each call's wall time and passes kept."""

    calls: list[tuple[float, list[float]]]

    def __call__(self, inputs):  # type: ignore[no-untyped-def]
        started = time.perf_counter()
        out = super().__call__(inputs)
        self.calls.append(((time.perf_counter() - started) * 1e3, out.pass_ms.tolist()))
        return out


def median_ms(fn, repeats: int = 30) -> float:  # type: ignore[no-untyped-def]
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def parts(head, vocab, rows: int, target, prompts) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """ms of each part of one pass over `rows` rows, 100 cached entries each; the features
    are the target's own at the prompts' last tokens, so the warp sees peaked distributions."""
    gen = torch.Generator().manual_seed(0)
    width = head.config.width
    features = torch.cat(
        [final_features(target, torch.tensor([p]))[0, -1:] for p in prompts[:rows]]
    )
    tokens = torch.randint(0, head.config.vocab_size, (rows,), generator=gen)
    cache = head.layers.new_cache(rows, 256, "cpu")
    for r in range(rows):
        cache.allocate(r)
        entries = torch.randn(100, width, generator=gen).bfloat16()
        head.forward_cached(cache, [r], entries, torch.randint(0, 1000, (100,)), [100])
    embeds = head.inputs(features, tokens)

    def block() -> None:
        head.layers.forward_cached(cache, list(range(rows)), tokens, [1] * rows, hidden=True,
                                   embeds=embeds)  # fmt: skip
        for r in range(rows):
            cache.rollback(r, 100)

    kept = head.layers.embed.weight[torch.tensor(vocab.token_ids)].contiguous()
    logits = (features @ kept.t())[:, None].float()
    warp = torch.full((rows,), 0.7), torch.full((rows,), 0.95)
    return {
        "fc": median_ms(lambda: head.inputs(features, tokens)),
        "block": median_ms(block),
        f"output layer ({len(vocab.token_ids)} ids)": median_ms(lambda: features @ kept.t()),
        "warp": median_ms(lambda: warp_probs(logits, *warp)),
    }


def main() -> None:
    torch.set_num_threads(1)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    print(f"# host: {platform.processor() or 'cpu'}; flags: {[f for f in wanted if f in flags]}")
    print("# 1 thread, bf16, models/target + models/head, its draft vocabulary")
    target = load_model(ROOT / "models/target", dtype=torch.bfloat16, max_length=CONTEXT)
    head = load_head_dir(ROOT / "models/head", "cpu", torch.bfloat16, CONTEXT)
    vocab = resolve_draft_vocab(ROOT / "models/head", DRAFT_VOCAB_AUTO, target.vocab_size)
    tokenizer = load_tokenizer(ROOT / "models/target")
    lines = (ROOT / "workloads/chat.jsonl").read_text().splitlines()
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]
    for rows in ROWS:
        step = SpeculativeStep.from_models(target, head, StepCapacity(8, max(ROWS), CONTEXT))
        stage = TimedStage(head, head.layers.new_cache(max(ROWS), CONTEXT, "cpu"), 8,
                           draft_vocab=vocab)  # fmt: skip
        stage.calls = []
        step.draft = stage
        scheduler = Scheduler(step, tokenizer.eos_ids, max(ROWS), CONTEXT, 8)
        requests = [GenerationRequest(p, 48, temperature=0.7, top_p=0.95, num_draft_tokens=4,
                                      adaptive=False, random_seed=i)
                    for i, p in enumerate(prompts[:rows])]  # fmt: skip
        generate(scheduler, requests)
        stage.calls = []
        generate(scheduler, requests)
        steady = [c for c in stage.calls[2:] if any(c[1])]
        passes = [p for _, ms in steady for p in ms[1:] if p > 0]
        whole = statistics.median(c[0] for c in steady)
        entry = statistics.median(ms[0] for _, ms in steady)
        print(f"\nrows {rows}: {len(steady)} steps; the stage {whole:.2f} ms a step, its entry "
              f"pass {entry:.2f} ms, a draft pass {statistics.median(passes):.2f} ms (median of "
              f"{len(passes)})")  # fmt: skip
        for name, ms in parts(head, vocab, rows, target, prompts).items():
            print(f"  {name:<26} {ms:6.2f} ms")


if __name__ == "__main__":
    main()
