#!/usr/bin/env python3
"""Measure the cost tables of a running deployment from Triton's own per-model metrics.

`client/profile_costs.py` times the torch stages in-process; a deployment whose target is a
TensorRT-LLM engine (docs/gpu.md) can only be timed where it runs. This script loads the server
with greedy requests at fixed K and adaptive verification off (so every draft is verified and a
step's work is known), and per (concurrency, K) point reads from the metrics endpoint:

- draft ms and target ms per step = delta of `nv_inference_compute_infer_duration_us` / delta of
  `nv_inference_exec_count` of the draft and target models (one execution each per step);
- sequences per step = delta av_step_batch_size_sum / delta av_step_batch_size_count;
- target tokens per step = (sequences + delta av_verified_tokens_total + prompt tokens) / steps.

Prompts are cut to --prompt-bytes (byte tokenizer: one token per byte) so that prefill, which
the target and draft run inside the first step of each sequence, stays a small share; its tokens
are still counted. Requests are long (--max-tokens 64) so the batch is full most of the time.

Verify points come from every K; draft points (the draft cost is indexed by batch size at the
full K) from K = max only. Writes the verifier's `cost_tables` JSON (same format as
profile_costs.py, plus the raw points). Asserts nothing about speed.

    # CPU server (make serve):
    .venv/bin/python client/profile_serving_costs.py --out costs_served.json
    # GPU deployment (docs/gpu.md), then point the verifier's cost_tables at the file:
    python client/profile_serving_costs.py --target-model trtllm_target \\
        --out models/cost_tables_gpu.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from bench_overhead import generate_concurrently
from tqdm import tqdm

from avspec.av.cost_table import CostTable
from avspec.serving.metrics import metric_value, parse_metrics

ROOT = Path(__file__).resolve().parent.parent
COMPUTE = "nv_inference_compute_infer_duration_us"
EXECUTIONS = "nv_inference_exec_count"


def scrape(metrics_url: str) -> dict:
    with urllib.request.urlopen(metrics_url, timeout=30) as page:
        return parse_metrics(page.read().decode())


def counters(samples: dict, draft_model: str, target_model: str) -> dict[str, float]:
    """The cumulative counters one point is the difference of."""
    out = {
        "steps": metric_value(samples, "av_step_batch_size_count"),
        "sequences": metric_value(samples, "av_step_batch_size_sum"),
        "verified": metric_value(samples, "av_verified_tokens_total"),
    }
    for role, model in (("draft", draft_model), ("target", target_model)):
        out[f"{role}_us"] = metric_value(samples, COMPUTE, model=model)
        out[f"{role}_execs"] = metric_value(samples, EXECUTIONS, model=model)
    return out


def point(
    before: dict[str, float], after: dict[str, float], k: int, prompt_tokens: int
) -> dict[str, float]:
    """One measured point from two counter snapshots; ValueError if no step ran."""
    d = {name: after[name] - before[name] for name in before}
    if d["steps"] <= 0 or d["draft_execs"] <= 0 or d["target_execs"] <= 0:
        raise ValueError(f"no decode step was served at K = {k}: {d}")
    return {
        "k": k,
        "steps": d["steps"],
        "prompt_tokens": prompt_tokens,
        "sequences_per_step": d["sequences"] / d["steps"],
        "target_tokens_per_step": (d["sequences"] + d["verified"] + prompt_tokens) / d["steps"],
        "draft_ms": d["draft_us"] / d["draft_execs"] / 1e3,
        "target_ms": d["target_us"] / d["target_execs"] / 1e3,
    }


def table(points: list[dict], size: str, cost: str, name: str) -> dict:
    """Sizes and ms of `points` (same size averaged), checked by CostTable."""
    by_size: dict[float, list[float]] = {}
    for p in points:
        by_size.setdefault(round(p[size], 3), []).append(p[cost])
    sizes = sorted(by_size)
    millis = [sum(by_size[s]) / len(by_size[s]) for s in sizes]
    CostTable(sizes, millis, name=name)  # raises on anything a verifier would refuse
    return {"sizes": sizes, "millis": millis}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-url", default="http://localhost:8000")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics")
    parser.add_argument("--draft-model", default="draft")
    parser.add_argument("--target-model", default="target", help="GPU: trtllm_target")
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma list")
    parser.add_argument("--draft-tokens", default="0,2,8", help="comma list of K; max = full K")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt-bytes", type=int, default=16, help="prompts cut to this")
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "code.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="cost tables JSON to write")
    args = parser.parse_args(argv)
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
        args.draft_tokens = [int(k) for k in args.draft_tokens.split(",")]
    except ValueError:
        parser.error("--concurrency and --draft-tokens take comma lists of integers")
    if min(args.concurrency) < 1 or min(args.draft_tokens) < 0 or args.max_tokens < 1:
        parser.error("concurrency and max-tokens must be >= 1, draft tokens >= 0")
    if args.prompt_bytes < 1:
        parser.error("--prompt-bytes must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lines = args.workload.read_text(encoding="utf-8").splitlines()
    cut = [json.loads(line)["prompt"].encode()[: args.prompt_bytes] for line in lines]
    prompts = [p.decode(errors="ignore") for p in cut[: max(args.concurrency)]]
    if len(prompts) < max(args.concurrency):
        prompts *= -(-max(args.concurrency) // len(prompts))
    full_k = max(args.draft_tokens)
    grid = [(c, k) for k in args.draft_tokens for c in args.concurrency]
    points = []
    try:
        generate_concurrently(args.http_url, prompts[:1], 4, full_k)  # warm-up
        for c, k in tqdm(grid, desc="cost points", unit="point"):
            before = counters(scrape(args.metrics_url), args.draft_model, args.target_model)
            start = time.perf_counter()
            generate_concurrently(args.http_url, prompts[:c], args.max_tokens, k)
            after = counters(scrape(args.metrics_url), args.draft_model, args.target_model)
            prompt_tokens = sum(len(p.encode()) for p in prompts[:c])
            points.append({"concurrency": c, "seconds": time.perf_counter() - start,
                           **point(before, after, k, prompt_tokens)})  # fmt: skip
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    document = {
        "draft_cost": table(
            [p for p in points if p["k"] == full_k], "sequences_per_step", "draft_ms", "draft_cost"
        ),
        "verify_cost": table(points, "target_tokens_per_step", "target_ms", "verify_cost"),
        "source": f"Triton metrics of {args.http_url} (draft: {args.draft_model}, "
        f"target: {args.target_model})",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "max_draft_tokens": full_k,
        "points": points,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=2) + "\n")
    print(f"{'c':>3} {'K':>2} {'seq/step':>8} {'tokens/step':>11} {'draft ms':>9} {'target ms':>9}")
    for p in points:
        sizes = f"{p['sequences_per_step']:>8.1f} {p['target_tokens_per_step']:>11.1f}"
        costs = f"{p['draft_ms']:>9.1f} {p['target_ms']:>9.1f}"
        print(f"{p['concurrency']:>3} {p['k']:>2} {sizes} {costs}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
