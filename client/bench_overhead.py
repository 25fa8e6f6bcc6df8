#!/usr/bin/env python3
"""What the Triton hops cost: step time through the server vs the same step in-process.

Runs the same greedy requests (same models, same K, every draft verified: AV off, so that the
estimator's state, fresh in-process and warm-started in the server, cannot change the work a
step does) two ways, side by side in one run, at each concurrency:
  - in-process: avspec.engine.scheduler.Scheduler driving avspec.engine.step.SpeculativeStep;
  - Triton: the `speculative` entry model of a real server (HTTP /generate, one thread per
    request), whose scheduler makes one BLS call of the `speculative_step` ensemble per step.
Step time = wall time / decode steps (the server's steps are read from av_step_batch_size_count).
Greedy requests make both sides take the same steps. Prints a table and the Triton/in-process
ratio; asserts nothing.

    .venv/bin/python client/bench_overhead.py --concurrency 1,16 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch

from avspec.av.cost_file import default_step_cost, load_step_cost
from avspec.av.step_cost import StepCost
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.tokenizer import Tokenizer
from avspec.serving.host.server_process import ServerProcess
from avspec.serving.host.settings import ServeSettings
from avspec.serving.stages.metrics import metric_value, parse_metrics

ROOT = Path(__file__).resolve().parent.parent
MAX_LENGTH = 512  # KV positions per sequence


def step_cost(path: Path, max_sequences: int) -> StepCost:
    """The measured step cost at `path`, or the linear default when the file does not exist
    (a file that exists but is malformed or of the old format raises ValueError)."""
    try:
        return load_step_cost(path)
    except FileNotFoundError:
        print(f"bench_overhead: {path} not found: linear default step cost", file=sys.stderr)
        return default_step_cost(max_sequences * MAX_LENGTH, max_sequences * MAX_LENGTH)


def _prompts(workload: Path, count: int) -> list[str]:
    lines = workload.read_text(encoding="utf-8").splitlines()[:count]
    return [json.loads(line)["prompt"] for line in lines]


def in_process(
    step: SpeculativeStep, tokenizer: Tokenizer, prompts: list[str], max_tokens: int, k: int
) -> tuple:
    """(seconds, steps) for all prompts at once through one in-process scheduler; prompts are
    encoded with `tokenizer` (the target's, as the server's entry model does)."""
    counter = {"steps": 0}

    def counted(inputs):
        if inputs.batch_size:
            counter["steps"] += 1
        return step(inputs)

    scheduler = Scheduler(counted, tokenizer.eos_ids, len(prompts), MAX_LENGTH, k)
    errors: list[Exception] = []
    start = time.perf_counter()
    for prompt in prompts:
        request = GenerationRequest(
            tokenizer.encode(prompt),
            max_tokens,
            temperature=0.0,
            num_draft_tokens=k,
            adaptive=False,
        )
        scheduler.submit(request, lambda report: None, errors.append)
    scheduler.run_until_idle()
    if errors:
        raise RuntimeError(f"in-process request failed: {errors[0]!r}")
    return time.perf_counter() - start, counter["steps"]


def _steps_served(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=30) as page:
        text = page.read().decode()
    return metric_value(parse_metrics(text), "av_step_batch_size_count") or 0.0


def generate_concurrently(http_url: str, prompts: list[str], max_tokens: int, k: int) -> float:
    """Seconds to serve all prompts at once (greedy, K = k, AV off), one HTTP /generate thread
    per prompt; RuntimeError naming the first failure."""
    url = f"{http_url}/v2/models/speculative/generate"
    errors: list[str] = []

    def one(prompt: str) -> None:
        body = {"text_input": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(num_draft_tokens=k, adaptive_verification=False)
        request = urllib.request.Request(url, json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=600) as response:
                response.read()
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(repr(err))

    threads = [threading.Thread(target=one, args=(p,)) for p in prompts]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - start
    if errors:
        raise RuntimeError(f"Triton request failed: {errors[0]}")
    return seconds


def through_triton(server: ServerProcess, prompts: list[str], max_tokens: int, k: int) -> tuple:
    """(seconds, steps) for all prompts at once through the server."""
    before = _steps_served(server.metrics_url)
    seconds = generate_concurrently(server.http_url, prompts, max_tokens, k)
    return seconds, _steps_served(server.metrics_url) - before


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,16", help="comma list of concurrencies")
    parser.add_argument("--max-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--draft-tokens", type=int, default=8, help="K")
    parser.add_argument("--repeats", type=int, default=2, help="alternating rounds per point")
    parser.add_argument("--workload", type=Path, default=ROOT / "workloads" / "code.jsonl")
    parser.add_argument("--ports", default="18100,18101,18102", help="HTTP,gRPC,metrics")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the server runs every model process with one thread too
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    prompts = _prompts(args.workload, max(concurrencies))
    sequences = max(concurrencies) + 4
    cost = step_cost(ROOT / "models" / "cost_tables.json", sequences)
    step = SpeculativeStep.from_model_dirs(
        ROOT / "models" / "target", ROOT / "models" / "draft",
        StepCapacity(args.draft_tokens, sequences, MAX_LENGTH), "cpu", cost=cost,
    )  # fmt: skip
    tokenizer = load_tokenizer(ROOT / "models" / "target")
    ports = [int(p) for p in args.ports.split(",")]
    rows = []
    with (
        tempfile.TemporaryDirectory() as log_dir,
        ServerProcess(ServeSettings.for_repository(
            ROOT / "model_repository", ports, Path(log_dir) / "triton.log")) as server,
    ):  # fmt: skip
        through_triton(server, prompts[:1], 8, args.draft_tokens)  # warm-up
        in_process(step, tokenizer, prompts[:1], 8, args.draft_tokens)
        for c in concurrencies:
            local, served = [], []
            for _ in range(args.repeats):  # alternate so drift hits both alike
                local.append(
                    in_process(step, tokenizer, prompts[:c], args.max_tokens, args.draft_tokens)
                )
                served.append(
                    through_triton(server, prompts[:c], args.max_tokens, args.draft_tokens)
                )
            local_ms = 1e3 * sum(s for s, _ in local) / sum(n for _, n in local)
            served_ms = 1e3 * sum(s for s, _ in served) / sum(n for _, n in served)
            rows.append((c, local_ms, served_ms, local[0][1], served[0][1]))
    print(f"{'concurrency':>11} {'in-process ms/step':>19} {'Triton ms/step':>15} {'ratio':>6}"
          f" {'steps (in-proc/Triton)':>23}")  # fmt: skip
    for c, local_ms, served_ms, local_steps, served_steps in rows:
        print(f"{c:>11} {local_ms:>19.1f} {served_ms:>15.1f} {served_ms / local_ms:>6.2f}"
              f" {local_steps:>11}/{served_steps:<11.0f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
