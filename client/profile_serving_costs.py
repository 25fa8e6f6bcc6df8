#!/usr/bin/env python3
"""Measure the step cost of a running deployment from Triton's own per-model metrics.

`client/profile_costs.py` times the torch stages in-process; a deployment whose target is a
TensorRT-LLM engine (docs/gpu.md) can only be timed where it runs, and only there are the served
path's per-step hops (the ensemble's scheduling, the verifier model, tensor copies between the
models) paid. This script loads the server with greedy requests at fixed K and adaptive
verification off (so every draft is verified and a step's work is known), and per
(concurrency, K) point reads from the metrics endpoint:

- draft ms and target ms per step = delta of `nv_inference_compute_infer_duration_us` / delta of
  `nv_inference_exec_count` of the draft and target models (one execution each per step);
- served step ms = delta of `nv_inference_request_duration_us` / delta of
  `nv_inference_request_success` of the step ensemble (`--step-model`, one request per step);
- overhead ms = served step ms - draft ms - target ms (the fixed per-step cost of the path);
- sequences per step = delta av_step_batch_size_sum / delta av_step_batch_size_count;
- target tokens per step = (sequences + delta av_verified_tokens_total + prompt tokens) / steps.

Prompts are cut to --prompt-bytes so that prefill, which the target and draft run inside the
first step of each sequence, stays a small share; its tokens are still counted, with the served
pair's tokenizer (--tokenizer: the target's model directory). Requests are long
(--max-tokens 64) so the batch is full most of the time.

Tables (avspec.av.step_cost.StepCost, written with avspec.av.cost_file.save_step_cost):
- verify: target ms by target tokens per step, every point, weighted by its steps;
- draft_pass: one draft pass by rows. The draft runs K forwards a step (pass 0 over the pending
  tokens, then K - 1 over the rows; none at K = 0, where it defers its inputs and is called for
  nothing). At a concurrency served at K values with different numbers of forwards, a pass costs
  (draft ms at the largest K - at the smallest) / (difference of forwards), at the rows
  (sequences per step) of the largest K, so the draft model's per-call cost cancels out of the
  pass; at a single K > 0 it is draft ms / K;
- overhead_ms: the median over the points of step ms - target ms - the draft passes the table
  prices (pass 0 over the pending tokens, K - 1 passes over the rows), clamped at 0: the hops
  plus the draft model's per-call cost, which a step pays once whatever it drafts. Each point
  also keeps its plain hops, step ms - draft ms - target ms, as "overhead_ms".
Both tables are fitted isotonically. "measured" keeps the raw points and the check: for every
point, the step ms the written StepCost predicts (overhead + the passes + verify) against the
served step ms; with --check FILE, the same for another step-cost file (the in-process tables,
say), so its error on the deployment is known. Asserts nothing about speed.

    # CPU server (make serve):
    .venv/bin/python client/profile_serving_costs.py --out costs_served.json \\
        --check models/cost_tables.json
    # GPU deployment (docs/gpu.md), then point the verifier's cost_tables at the file:
    python client/profile_serving_costs.py --target-model trtllm_target \\
        --out models/cost_tables_gpu.json
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from bench_overhead import generate_concurrently
from tqdm import tqdm

from avspec.av.cost_file import load_step_cost, save_step_cost
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost
from avspec.runtime.model_dir import load_tokenizer
from avspec.serving.stages.metrics import metric_value, parse_metrics

ROOT = Path(__file__).resolve().parent.parent
COMPUTE = "nv_inference_compute_infer_duration_us"
EXECUTIONS = "nv_inference_exec_count"
REQUEST_US = "nv_inference_request_duration_us"
REQUESTS = "nv_inference_request_success"


def scrape(metrics_url: str) -> dict:
    with urllib.request.urlopen(metrics_url, timeout=30) as page:
        return parse_metrics(page.read().decode())


def counters(
    samples: dict, draft_model: str, target_model: str, step_model: str = "speculative_step"
) -> dict[str, float]:
    """The cumulative counters one point is the difference of."""
    out = {
        "steps": metric_value(samples, "av_step_batch_size_count"),
        "sequences": metric_value(samples, "av_step_batch_size_sum"),
        "verified": metric_value(samples, "av_verified_tokens_total"),
        "step_us": metric_value(samples, REQUEST_US, model=step_model),
        "step_requests": metric_value(samples, REQUESTS, model=step_model),
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
    if min(d["steps"], d["draft_execs"], d["target_execs"], d["step_requests"]) <= 0:
        raise ValueError(f"no decode step was served at K = {k}: {d}")
    draft_ms = d["draft_us"] / d["draft_execs"] / 1e3
    target_ms = d["target_us"] / d["target_execs"] / 1e3
    step_ms = d["step_us"] / d["step_requests"] / 1e3
    return {
        "k": k,
        "steps": d["steps"],
        "prompt_tokens": prompt_tokens,
        "sequences_per_step": d["sequences"] / d["steps"],
        "target_tokens_per_step": (d["sequences"] + d["verified"] + prompt_tokens) / d["steps"],
        "draft_ms": draft_ms,
        "target_ms": target_ms,
        "step_ms": step_ms,
        "overhead_ms": step_ms - draft_ms - target_ms,
    }


def _grouped(sizes: list[float], millis: list[float], weights: list[float]) -> dict:
    """Points with equal sizes (to 1e-3) merged: weighted mean ms, summed weight."""
    by_size: dict[float, tuple[float, float]] = {}
    for size, ms, w in zip(sizes, millis, weights, strict=True):
        key = round(size, 3)
        total, weight = by_size.get(key, (0.0, 0.0))
        by_size[key] = (total + ms * w, weight + w)
    keys = sorted(by_size)
    return {
        "sizes": keys,
        "millis": [by_size[k][0] / by_size[k][1] for k in keys],
        "weights": [by_size[k][1] for k in keys],
    }


def verify_points(points: list[dict]) -> dict:
    """Target ms by target tokens per step, weighted by steps."""
    return _grouped([p["target_tokens_per_step"] for p in points],
                    [p["target_ms"] for p in points], [p["steps"] for p in points])  # fmt: skip


def draft_pass_points(points: list[dict]) -> dict:
    """One draft pass by rows; see the module doc. ValueError when no point drafted."""
    sizes, millis, weights = [], [], []
    by_concurrency: dict[int, list[dict]] = {}
    for p in points:
        by_concurrency.setdefault(p["concurrency"], []).append(p)
    for group in by_concurrency.values():
        low = min(group, key=lambda p: p["k"])
        high = max(group, key=lambda p: p["k"])
        if high["k"] == 0:
            continue
        # The draft runs K forwards a step: none at K = 0 (its inputs deferred).
        passes = high["k"] - low["k"]
        if passes > 0:
            ms = (high["draft_ms"] - low["draft_ms"]) / passes
        else:
            ms = high["draft_ms"] / high["k"]
        sizes.append(high["sequences_per_step"])
        millis.append(max(ms, 0.0))  # a noisy difference is never below free
        weights.append(high["steps"])
    if not sizes:
        raise ValueError("no point drafted (every K was 0): the draft pass cannot be measured")
    return _grouped(sizes, millis, weights)


def step_cost_from_points(points: list[dict]) -> StepCost:
    """The StepCost of the points: isotonic tables, overhead as in the module doc."""
    draft, verify = draft_pass_points(points), verify_points(points)
    draft_pass = CostTable(draft["sizes"], draft["millis"], "draft_pass", draft["weights"])
    residual = [p["step_ms"] - p["target_ms"] - draft_passes_ms(draft_pass, p) for p in points]
    return StepCost(
        draft_pass,
        CostTable(verify["sizes"], verify["millis"], "verify", verify["weights"]),
        max(0.0, statistics.median(residual)),
    )


def draft_passes_ms(draft_pass: CostTable, p: dict) -> float:
    """The draft passes of one step of point p: pass 0 runs every pending token (a token per
    sequence plus the prompts' share), passes 1..K-1 one row per sequence; none at K = 0."""
    if p["k"] == 0:
        return 0.0
    rows = p["sequences_per_step"]
    pending = rows + p["prompt_tokens"] / p["steps"]
    return draft_pass.at(pending) + (p["k"] - 1) * draft_pass.at(rows)


def predicted_step_ms(cost: StepCost, p: dict) -> float:
    """What `cost` says one step of point p costs: overhead + draft passes + verify."""
    return (
        cost.overhead_ms
        + draft_passes_ms(cost.draft_pass, p)
        + cost.verify.at(p["target_tokens_per_step"])
    )


def check(cost: StepCost, points: list[dict]) -> dict:
    """Per point predicted vs served step ms; median absolute relative error over points."""
    rows = []
    for p in points:
        predicted = predicted_step_ms(cost, p)
        rows.append({"concurrency": p["concurrency"], "k": p["k"], "served_ms": p["step_ms"],
                     "predicted_ms": predicted,
                     "relative_error": (predicted - p["step_ms"]) / p["step_ms"]})  # fmt: skip
    error = statistics.median(abs(r["relative_error"]) for r in rows)
    return {"median_abs_relative_error": error, "points": rows}


def print_points(points: list[dict], measured: dict, overhead_ms: float) -> None:
    """One line per point: sizes, the three ms, overhead, the tables' step-ms error."""
    checks = [measured["check"]] + ([measured["check_other"]] if "check_other" in measured else [])
    print(f"{'c':>3} {'K':>2} {'seq/step':>8} {'tokens/step':>11} {'draft ms':>9} "
          f"{'target ms':>9} {'step ms':>8} {'overhead':>8} {'fit err':>7}"
          + (f" {'--check':>7}" if len(checks) > 1 else ""))  # fmt: skip
    for i, p in enumerate(points):
        sizes = f"{p['sequences_per_step']:>8.1f} {p['target_tokens_per_step']:>11.1f}"
        costs = f"{p['draft_ms']:>9.1f} {p['target_ms']:>9.1f} {p['step_ms']:>8.1f}"
        errors = " ".join(f"{c['points'][i]['relative_error']:>+7.1%}" for c in checks)
        print(
            f"{p['concurrency']:>3} {p['k']:>2} {sizes} {costs} {p['overhead_ms']:>8.2f} {errors}"
        )
    print(f"overhead_ms {overhead_ms:.2f} (median over points)")
    for c in checks:
        source = c.get("file", "the written tables")
        print(f"{source}: step ms on the served steps, median |error| "
              f"{c['median_abs_relative_error']:.1%}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--http-url", default="http://localhost:8000")
    parser.add_argument("--metrics-url", default="http://localhost:8002/metrics")
    parser.add_argument("--draft-model", default="draft")
    parser.add_argument("--target-model", default="target", help="GPU: trtllm_target")
    parser.add_argument(
        "--step-model", default="speculative_step", help="the ensemble run once per step"
    )
    parser.add_argument("--concurrency", default="1,4,16,64", help="comma list")
    parser.add_argument("--draft-tokens", default="0,2,8", help="comma list of K; max = full K")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request")
    parser.add_argument("--prompt-bytes", type=int, default=16, help="prompts cut to this")
    parser.add_argument(
        "--tokenizer", type=Path, default=ROOT / "models" / "target",
        help="model directory whose tokenizer.json counts the prompt tokens (the served target)",
    )  # fmt: skip
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "code.jsonl")
    parser.add_argument("--out", type=Path, required=True, help="step-cost JSON to write")
    parser.add_argument(
        "--check", type=Path, default=None,
        help="a step-cost file to check against the served step times too",
    )  # fmt: skip
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
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    other = None
    if args.check is not None:
        try:
            other = load_step_cost(args.check)
        except (OSError, ValueError) as err:
            print(f"error: --check: {err}", file=sys.stderr)
            return 2
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except ValueError as err:
        print(f"error: --tokenizer: {err}", file=sys.stderr)
        return 2
    lines = args.workload.read_text(encoding="utf-8").splitlines()
    cut = [json.loads(line)["prompt"].encode()[: args.prompt_bytes] for line in lines]
    prompts = [p.decode(errors="ignore") for p in cut[: max(args.concurrency)]]
    if len(prompts) < max(args.concurrency):
        prompts *= -(-max(args.concurrency) // len(prompts))
    full_k = max(args.draft_tokens)
    grid = [(c, k) for k in args.draft_tokens for c in args.concurrency]
    models = (args.draft_model, args.target_model, args.step_model)
    points = []
    try:
        generate_concurrently(args.http_url, prompts[:1], 4, full_k)  # warm-up
        for c, k in tqdm(grid, desc="cost points", unit="point"):
            before = counters(scrape(args.metrics_url), *models)
            start = time.perf_counter()
            generate_concurrently(args.http_url, prompts[:c], args.max_tokens, k)
            after = counters(scrape(args.metrics_url), *models)
            prompt_tokens = sum(len(tokenizer.encode(p)) for p in prompts[:c])
            points.append({"concurrency": c, "seconds": time.perf_counter() - start,
                           **point(before, after, k, prompt_tokens)})  # fmt: skip
        cost = step_cost_from_points(points)
    except (OSError, RuntimeError, KeyError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    measured = {
        "command": shlex.join(["python", "client/profile_serving_costs.py", *argv]),
        "source": f"Triton metrics of {args.http_url} (draft: {args.draft_model}, "
        f"target: {args.target_model}, step: {args.step_model})",
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "max_draft_tokens": full_k,
        "draft_pass": draft_pass_points(points),
        "verify": verify_points(points),
        "overhead_ms": [p["overhead_ms"] for p in points],
        "points": points,
        "check": check(cost, points),
    }
    if other is not None:
        measured["check_other"] = {"file": str(args.check), **check(other, points)}
    save_step_cost(args.out, cost, measured)
    print_points(points, measured, cost.overhead_ms)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
