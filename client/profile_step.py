#!/usr/bin/env python3
"""Where one speculative step's time goes, in process: model compute against everything else.

    .venv/bin/python client/profile_step.py --engine llamacpp,torch --rows 1,16,64 \\
        --arms none,k4,ad8 --steps 12 --out bench/step_breakdown

The default pair's stages (`--engine`: each directory's model.gguf on llama.cpp's engine, or the
checkpoints in the `auto` precision on torch) step `--rows` chat prompts of workloads/chat.jsonl
(the served prompt text) through `SpeculativeStep` with the served verifier (the estimator at
its defaults and `--cost-tables`), the scheduler's own bookkeeping included. The first
steps (every prompt's prefill) are not counted; then `--steps` steps are, with every row kept
busy (`max_tokens` large enough). Per step: the draft stage, the verifier and the target stage,
each split into its model's compute (`forward_cached` and the output layer: `logits`,
`subset_logits`) and the rest (sampling, warping, top-p, rejection, packing, the stage's checks);
and the step's remaining time (scheduler, contract tensors). The served path adds the Triton
hops between the stages and the entry, which `avspec.tools.bench.step_breakdown` reads from a
running server's metrics (docs/benchmarks.md).

Arms: `none` (no drafts), `kN` (N drafts a row, adaptive verification off), `adN` (AV with
adaptive drafting, N the maximum: the served default). Writes breakdown.json and summary.txt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.verifier import AdaptiveVerifier
from avspec.config import EstimatorConfig
from avspec.engine.draft_stage import DraftStage
from avspec.engine.draft_vocab import resolve_draft_vocab
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep
from avspec.engine.target_stage import TargetStage
from avspec.runtime.cpu_features import read_cpu_flags
from avspec.runtime.hf_files import GGUF_FILE
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.precision import load_served_model
from avspec.serving.stages.adapters import load_cost_tables

ROOT = Path(__file__).resolve().parents[1]
K = 8
MODEL_CALLS = ("forward_cached", "logits", "subset_logits")


class Clock:
    """Seconds spent in named parts; `part(name, fn)` wraps a callable to count into `name`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def part(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started

        return timed


def load_models(engine: str, rows: int, threads: int) -> tuple[Any, Any]:
    if engine == "llamacpp":
        settings = EngineSettings(
            max_sequences=rows, pool_tokens=rows * 1024, max_outputs=rows * (K + 1),
            threads=threads, max_length=1024,
        )  # fmt: skip
        return (GGUFModel(ROOT / "models/target" / GGUF_FILE, settings),
                GGUFModel(ROOT / "models/draft" / GGUF_FILE, settings))  # fmt: skip
    return (load_served_model(ROOT / "models/target", "cpu", "auto"),
            load_served_model(ROOT / "models/draft", "cpu", "auto"))  # fmt: skip


def build_step(engine: str, rows: int, threads: int, clock: Clock, costs: Path) -> SpeculativeStep:
    target, draft = load_models(engine, rows, threads)
    for role, model in (("target", target), ("draft", draft)):
        for call in MODEL_CALLS:
            if hasattr(model, call):
                setattr(model, call, clock.part(f"{role}_model", getattr(model, call)))
    vocab = resolve_draft_vocab(ROOT / "models/draft", "auto", draft.vocab_size)
    draft_stage = DraftStage(draft, draft.new_cache(rows, 1024), K, draft_vocab=vocab)
    target_stage = TargetStage(target, target.new_cache(rows, 1024), K)
    estimator = AcceptanceEstimator(EstimatorConfig(num_positions=K), "cpu")
    verifier = AdaptiveVerifier(estimator, load_cost_tables(costs))
    step = SpeculativeStep(draft_stage, verifier, target_stage)
    step.draft = clock.part("draft", step.draft)
    step.target = clock.part("target", step.target)
    verifier.step = clock.part("verifier", verifier.step)
    return step


def request(prompt: list[int], arm: str, max_tokens: int) -> GenerationRequest:
    if arm == "none":
        return GenerationRequest(prompt, max_tokens, 0.7, 0.95, num_draft_tokens=0)
    depth = int(arm[2:] if arm.startswith("ad") else arm[1:])
    adaptive = arm.startswith("ad")
    return GenerationRequest(prompt, max_tokens, 0.7, 0.95, num_draft_tokens=depth,
                             adaptive=adaptive, adaptive_drafting=adaptive)  # fmt: skip


def measure(
    engine: str, rows: int, arm: str, steps: int, threads: int, costs: Path
) -> dict[str, Any]:
    clock = Clock()
    step = build_step(engine, rows, threads, clock, costs)
    tokenizer = load_tokenizer(ROOT / "models/target")
    lines = (ROOT / "workloads/chat.jsonl").read_text().splitlines()
    prompts = [tokenizer.encode(json.loads(lines[i % len(lines)])["prompt"]) for i in range(rows)]
    scheduler = Scheduler(step, {1 << 30}, rows, 1024, K)  # an EOS never drawn: rows stay busy
    produced = [0]
    for prompt in prompts:
        scheduler.submit(request(prompt, arm, 1024 - len(prompt) - K),
                         lambda r: produced.__setitem__(0, produced[0] + len(r.new_tokens)),
                         lambda e: print(f"error: {e}", file=sys.stderr))  # fmt: skip
    for _ in range(3):  # prefill and the first decode steps, not counted
        scheduler.step()
    clock.seconds.clear()
    produced[0] = 0
    walls = []
    for _ in range(steps):
        started = time.perf_counter()
        scheduler.step()
        walls.append(time.perf_counter() - started)
    per = {name: 1e3 * s / steps for name, s in clock.seconds.items()}
    step_ms = 1e3 * sum(walls) / steps
    model_ms = per.get("draft_model", 0.0) + per.get("target_model", 0.0)
    return {
        "engine": engine, "rows": rows, "arm": arm, "steps": steps,
        "step_ms": step_ms, "step_ms_median": 1e3 * statistics.median(walls),
        "tokens_per_step": produced[0] / steps,
        "tokens_per_s": produced[0] / sum(walls),
        "draft_model_ms": per.get("draft_model", 0.0),
        "draft_rest_ms": per.get("draft", 0.0) - per.get("draft_model", 0.0),
        "verifier_ms": per.get("verifier", 0.0),
        "target_model_ms": per.get("target_model", 0.0),
        "target_rest_ms": per.get("target", 0.0) - per.get("target_model", 0.0),
        "scheduler_ms": step_ms - per.get("draft", 0.0) - per.get("verifier", 0.0)
        - per.get("target", 0.0),
        "not_model_share": 1 - model_ms / step_ms,
    }  # fmt: skip


COLUMNS = ("engine", "rows", "arm", "step_ms", "tokens_per_step", "tokens_per_s", "draft_model_ms",
           "draft_rest_ms", "verifier_ms", "target_model_ms", "target_rest_ms", "scheduler_ms",
           "not_model_share")  # fmt: skip


def table(results: list[dict[str, Any]]) -> str:
    head = " | ".join(COLUMNS)
    lines = [f"| {head} |", "|" + "---|" * len(COLUMNS)]
    for r in results:
        cells = [f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", default="llamacpp,torch", help="comma list")
    parser.add_argument("--rows", default="1,16,64", help="comma list")
    parser.add_argument("--arms", default="none,ad8", help="comma list: none, kN, adN")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--threads", type=int, default=0, help="llamacpp threads (0: every core)")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument(
        "--cost-tables", default="",
        help="the verifier's tables by engine, e.g. torch=PATH,llamacpp=PATH (the launcher's "
        "measured ones: make costs prints them); an engine not named: models/cost_tables.json",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=ROOT / "bench/step_breakdown")
    args = parser.parse_args(argv)
    named = dict(item.split("=", 1) for item in args.cost_tables.split(",") if item)
    recorded = ROOT / "models/cost_tables.json"
    costs = {e: Path(named.get(e, recorded)) for e in args.engine.split(",")}
    torch.set_num_threads(args.torch_threads)
    results = []
    for engine in args.engine.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for arm in args.arms.split(","):
                result = measure(engine, rows, arm, args.steps, args.threads, costs[engine])
                print(json.dumps({k: round(v, 3) if isinstance(v, float) else v
                                  for k, v in result.items()}), flush=True)  # fmt: skip
                results.append(result)
    flags = sorted(f for f in read_cpu_flags() if f.startswith(("avx", "amx")))
    args.out.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(sys.argv), "cpu_flags": flags, "results": results}
    (args.out / "breakdown.json").write_text(json.dumps(document, indent=2) + "\n")
    summary = f"{' '.join(sys.argv)}\nCPU flags: {' '.join(flags)}\n\n{table(results)}\n"
    (args.out / "summary.txt").write_text(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
