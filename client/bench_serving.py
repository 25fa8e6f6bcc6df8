"""Serving benchmark: concurrency x arms x workloads against the `speculative` model over gRPC.

Arms: `none` (no speculation), `k<N>` (fixed N drafts, AV off: all verified), `av<N>` (N drafts,
adaptive verification on, drafting fixed), `ad<N>` (adaptive verification and adaptive drafting:
at most N drafts); `default` = none, k1..kKmax, avKmax, adKmax. Each user is a closed loop (a new
request as soon as its previous one ends) on one streaming gRPC connection; one response per
decode step gives TTFT and inter-token latency. For each workload and concurrency the arms run
in `--rounds` rounds, the arm order rotated every round, so drift hits every arm alike.
Statistics and the frontier are defined in avspec.tools.bench.frontier (and docs/benchmarks.md).

Writes to --out: points.json (config, every point, goals), points.csv, frontier_<workload>.png
(throughput vs interactivity, AV highlighted), summary.txt (arms on the frontier per
concurrency, goals).

    python client/bench_serving.py --start-server --out bench/serving      # full sweep
    python client/bench_serving.py --url 127.0.0.1:8001 --concurrency 1,4 --arms none,k2,av8 \
        --workloads code --max-tokens 32 --out /tmp/bench
"""

from __future__ import annotations

import argparse
import csv
import json
import queue
import sys
import time
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm

from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.tokenizer import Tokenizer
from avspec.serving.repository import SERVING_DTYPES
from avspec.serving.stages.metrics import Samples, parse_metrics
from avspec.tools.bench.frontier import (
    X_KEY,
    Y_KEY,
    RequestRecord,
    frontier_by_concurrency,
    goal_checks,
    mark_frontier,
    plot_frontier,
    summarize_arm,
)
from avspec.tools.bench.step_breakdown import step_breakdown
from avspec.tools.script import doc_parser

MODEL = "speculative"
ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Arm:
    name: str
    num_draft_tokens: int
    adaptive: bool
    drafting: bool = False  # adaptive drafting (with adaptive verification)


def parse_arms(spec: str, kmax: int) -> list[Arm]:
    """`default` or a comma list of none / k<N> / av<N> / ad<N> (1 <= N <= kmax)."""
    names = ["none", *(f"k{k}" for k in range(1, kmax + 1)), f"av{kmax}", f"ad{kmax}"]
    names = names if spec == "default" else [s.strip() for s in spec.split(",") if s.strip()]
    arms = []
    for name in names:
        if name == "none":
            arms.append(Arm(name, 0, False))
            continue
        prefix = next((p for p in ("av", "ad", "k") if name.startswith(p)), None)
        digits = name[len(prefix) :] if prefix else ""
        if not digits.isdigit() or not 1 <= int(digits) <= kmax:
            raise ValueError(
                f"bad arm {name!r}: use none, k<N>, av<N> or ad<N> with 1 <= N <= {kmax}"
            )
        arms.append(Arm(name, int(digits), prefix in ("av", "ad"), prefix == "ad"))
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"duplicate arms in {spec!r}")
    return arms


class StreamClient:
    """One gRPC bidirectional stream; responses are timestamped in the callback."""

    def __init__(self, url: str, args: argparse.Namespace) -> None:
        self.args = args
        self.results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(url)
        self.client.start_stream(callback=self._on_response)

    def _on_response(self, result: Any, error: Any) -> None:
        self.results.put((time.perf_counter(), result, error))

    def send(self, request_id: str, prompt: str, arm: Arm, seed: int) -> None:
        a = self.args
        values = {
            "text_input": (np.array([prompt.encode()], dtype=object), "BYTES"),
            "max_tokens": (np.array([a.max_tokens], dtype=np.int32), "INT32"),
            "temperature": (np.array([a.temperature], dtype=np.float32), "FP32"),
            "top_p": (np.array([a.top_p], dtype=np.float32), "FP32"),
            "random_seed": (np.array([seed], dtype=np.uint64), "UINT64"),
            "stream": (np.array([True]), "BOOL"),
            "num_draft_tokens": (np.array([arm.num_draft_tokens], dtype=np.int32), "INT32"),
            "adaptive_verification": (np.array([arm.adaptive]), "BOOL"),
            "adaptive_drafting": (np.array([arm.drafting]), "BOOL"),
            "ignore_eos": (np.array([a.ignore_eos]), "BOOL"),
        }
        inputs = []
        for name, (array, datatype) in values.items():
            tensor = grpcclient.InferInput(name, [1], datatype)
            tensor.set_data_from_numpy(array)
            inputs.append(tensor)
        self.client.async_stream_infer(
            MODEL, inputs, request_id=request_id, enable_empty_final_response=True
        )

    def close(self) -> None:
        self.client.stop_stream(cancel_requests=True)
        self.client.close()


def run_phase(
    client: StreamClient,
    prompts: list[str],
    arm: Arm,
    concurrency: int,
    num_requests: int,
    tag: str,
    bar: tqdm | None = None,
) -> tuple[list[RequestRecord], float]:
    """Closed loop of `concurrency` users until `num_requests` requests finish; (records, s).

    Request i uses prompt i (cycled) and seed `--seed` + i, the same for every arm.
    """
    pending: dict[str, RequestRecord] = {}
    done: list[RequestRecord] = []
    sent = 0

    def launch() -> None:
        nonlocal sent
        request_id = f"{tag}-{sent}"
        pending[request_id] = RequestRecord(sent=time.perf_counter())
        client.send(request_id, prompts[sent % len(prompts)], arm, client.args.seed + sent)
        sent += 1

    start = time.perf_counter()
    for _ in range(min(concurrency, num_requests)):
        launch()
    while pending:
        try:
            t, result, error = client.results.get(timeout=client.args.request_timeout)
        except queue.Empty:
            raise RuntimeError(f"no response for {client.args.request_timeout} s") from None
        if error is not None:
            raise RuntimeError(f"request failed ({arm.name}, concurrency {concurrency}): {error}")
        response = result.get_response()
        record = pending[response.id]
        if response.outputs:
            record.chunk_times.append(t)
            record.chunk_tokens.append(len(result.as_numpy("output_ids")))
            record.drafted += int(result.as_numpy("drafted_tokens")[0])
            record.verified += int(result.as_numpy("verified_tokens")[0])
            record.accepted += int(result.as_numpy("accepted_tokens")[0])
        if response.parameters["triton_final_response"].bool_param:
            done.append(pending.pop(response.id))
            if bar is not None:
                bar.update(1)
            if sent < num_requests:
                launch()
    return done, time.perf_counter() - start


def load_prompts(
    directory: Path,
    workload: str,
    count: int,
    max_tokens: int | None = None,
    tokenizer: Tokenizer | None = None,
) -> list[str]:
    """`count` prompts of the workload spread over its file; with `max_tokens`, only those of
    at most that many tokens by `tokenizer` (an answer of --max-tokens must fit the context)."""
    lines = (directory / f"{workload}.jsonl").read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    if max_tokens is not None and tokenizer is not None:
        prompts = [p for p in prompts if len(tokenizer.encode(p)) <= max_tokens]
        if not prompts:
            raise SystemExit(f"{workload}: no prompt of at most {max_tokens} tokens")
    count = min(count, len(prompts))
    return [prompts[i * len(prompts) // count] for i in range(count)]


def prompt_tokenizer(args: argparse.Namespace) -> Tokenizer | None:
    """The tokenizer that counts prompts for --max-prompt-tokens (None without it)."""
    if args.max_prompt_tokens is None:
        return None
    return load_tokenizer(args.tokenizer)


def sweep(
    client: StreamClient,
    args: argparse.Namespace,
    arms: list[Arm],
    metrics_url: str | None = None,
    on_points: Callable[[list[dict]], None] | None = None,
) -> list[dict]:
    """Run every (workload, concurrency, round, arm) phase; return one point per arm.

    With `metrics_url`, each point also gets where its steps' time went (avspec.tools.
    step_breakdown over the phases of that arm, prefixed `step_`): the server's metrics are
    scraped around every phase. `on_points` gets the points so far each time a (workload,
    concurrency) is complete, so a long sweep that is stopped keeps what it measured.
    """
    phases = [
        (w, c, r, arms[(i + r) % len(arms)])
        for w in args.workloads
        for c in args.concurrency
        for r in range(args.rounds)
        for i in range(len(arms))
    ]
    total = sum(requests_per_phase(args, c) for _, c, _, _ in phases)
    tokenizer = prompt_tokenizer(args)
    prompts = {
        w: load_prompts(args.workload_dir, w, args.prompts, args.max_prompt_tokens, tokenizer)
        for w in args.workloads
    }
    if args.warmup_requests:
        av = [a for a in arms if a.adaptive] or arms
        c = max(args.concurrency)
        run_phase(client, prompts[args.workloads[0]], av[0], c, args.warmup_requests, "warmup")
    runs: dict[tuple[str, int, str], tuple[list[RequestRecord], float]] = {}
    scrapes: dict[tuple[str, int, str], list[tuple[Samples, Samples]]] = {}
    windows: dict[tuple[str, int, str], list[list[float]]] = {}  # wall clock, for step logs
    with tqdm(total=total, desc="bench", unit="req", file=sys.stderr) as bar:
        for n, (w, c, r, arm) in enumerate(phases):
            bar.set_postfix_str(f"{w} c={c} {arm.name} round {r + 1}")
            before = scrape(metrics_url) if metrics_url else None
            opened = time.time()
            records, wall = run_phase(
                client, prompts[w], arm, c, requests_per_phase(args, c), f"p{n}", bar
            )
            windows.setdefault((w, c, arm.name), []).append([opened, time.time()])
            if before is not None:
                scrapes.setdefault((w, c, arm.name), []).append((before, scrape(metrics_url)))
            old_records, old_wall = runs.get((w, c, arm.name), ([], 0.0))
            runs[(w, c, arm.name)] = (old_records + records, old_wall + wall)
            if on_points and n + 1 < len(phases) and phases[n + 1][:2] != (w, c):
                on_points(sweep_points(runs, scrapes, windows, arms))
    return sweep_points(runs, scrapes, windows, arms)


def sweep_points(
    runs: dict[tuple[str, int, str], tuple[list[RequestRecord], float]],
    scrapes: dict[tuple[str, int, str], list[tuple[Samples, Samples]]],
    windows: dict[tuple[str, int, str], list[list[float]]],
    arms: list[Arm],
) -> list[dict]:
    """One point per (workload, concurrency, arm) measured, the frontier marked."""
    by_name = {a.name: a for a in arms}
    points = []
    for (w, c, name), (records, wall) in runs.items():
        arm = by_name[name]
        points.append(
            {
                "workload": w,
                "concurrency": c,
                "arm": name,
                "num_draft_tokens": arm.num_draft_tokens,
                "adaptive": arm.adaptive,
                "drafting": arm.drafting,
                **summarize_arm(records, wall),
                **phase_breakdown(scrapes.get((w, c, name), [])),
                "windows": windows[(w, c, name)],
            }
        )
    mark_frontier(points)
    return points


def phase_breakdown(pairs: list[tuple[Samples, Samples]]) -> dict[str, float]:
    """Step breakdown over phases, weighted by their steps; {} without scrapes."""
    parts = [step_breakdown(before, after) for before, after in pairs]
    steps = sum(p["steps"] for p in parts)
    if not parts or steps <= 0:
        return {}
    out = {"step_count": steps}
    for key in parts[0]:
        if key != "steps":
            out[f"step_{key}" if not key.startswith("step_") else key] = (
                sum(p[key] * p["steps"] for p in parts if p["steps"] > 0) / steps
            )
    return out


def scrape(metrics_url: str) -> Samples:
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        return parse_metrics(response.read().decode())


def requests_per_phase(args: argparse.Namespace, concurrency: int) -> int:
    return max(args.requests_per_user * concurrency, args.min_requests)


def write_outputs(out: Path, args: argparse.Namespace, arms: list[Arm], points: list[dict]) -> str:
    out.mkdir(parents=True, exist_ok=True)
    adaptive = [a.name for a in arms if a.adaptive]
    av = next((a.name for a in reversed(arms) if a.drafting), adaptive[-1] if adaptive else "")
    fixed = [a.name for a in arms if not a.adaptive and a.num_draft_tokens > 0]
    goals = {
        w: {name: goal_checks(points, w, name, fixed) for name in adaptive} for w in args.workloads
    }
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {"config": config, "points": points, "goals": goals}
    (out / "points.json").write_text(json.dumps(document, indent=1) + "\n")
    with (out / "points.csv").open("w", newline="") as f:
        fields = [k for k in dict.fromkeys(key for p in points for key in p) if k != "windows"]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(points)
    for w in args.workloads:
        plot_frontier(out / f"frontier_{w}.png", w, points, av)
    text = summary_text(args, points, goals, av)
    (out / "summary.txt").write_text(text)
    return text


def summary_text(args: argparse.Namespace, points: list[dict], goals: dict, av: str) -> str:
    lines = [
        f"bench_serving: temperature {args.temperature}, top-p {args.top_p}, max_tokens "
        f"{args.max_tokens}, rounds {args.rounds}",
    ]
    for w in args.workloads:
        lines += ["", f"== {w} =="]
        lines.append(
            f"{'conc':>4} {'arm':>5} {'tok/s':>8} {'tok/s/user':>10} {'TTFT ms':>8} "
            f"{'ITL p50':>8} {'ITL p99':>8} {'acc/pass':>8} {'frontier':>8}"
        )
        rows = sorted((p for p in points if p["workload"] == w), key=lambda p: p["concurrency"])
        for p in rows:
            lines.append(
                f"{p['concurrency']:>4} {p['arm']:>5} {p[Y_KEY]:>8.1f} {p[X_KEY]:>10.1f} "
                f"{p['ttft_ms_median']:>8.1f} {p['itl_ms_median']:>8.1f} {p['itl_ms_p99']:>8.1f} "
                f"{p['accepted_per_pass']:>8.2f} {'*' if p.get('on_frontier') else '':>8}"
            )
        if any("step_ms" in p for p in rows):
            lines.append(
                f"per step (server metrics): {'conc':>4} {'arm':>5} {'step ms':>8} "
                f"{'draft':>6} {'verif':>6} {'target':>6} {'hops':>6} {'drafted':>7} "
                f"{'verified':>8} {'stopped':>7} {'saved ms':>8}"
            )
            for p in (p for p in rows if "step_ms" in p):
                lines.append(
                    f"{'':>26} {p['concurrency']:>4} {p['arm']:>5} {p['step_ms']:>8.1f} "
                    f"{p['step_draft_ms']:>6.1f} {p['step_verifier_ms']:>6.1f} "
                    f"{p['step_target_ms']:>6.1f} {p['step_overhead_ms']:>6.1f} "
                    f"{p['step_drafted']:>7.1f} {p['step_verified']:>8.1f} "
                    f"{p['step_stopped_early']:>7.1f} {p['step_draft_ms_saved']:>8.1f}"
                )
        for c, on in frontier_by_concurrency(points, w).items():
            lines.append(f"concurrency {c}: on the frontier: {', '.join(on) or '-'}")
        for arm, g in goals.get(w, {}).items():
            ratios = ", ".join(f"c={c}: {r:.3f}" for c, r in g["av_over_best_fixed"].items())
            lines.append(
                f"{arm} / best fixed K: {ratios} (goals >= 1.10 from c=16: "
                f"{'met' if g['high_goal_met'] else 'missed'}; >= 0.98 below: "
                f"{'met' if g['low_goal_met'] else 'missed'}); {arm} on the frontier at "
                f"{g['av_on_frontier_count']} of {g['concurrencies']} concurrencies "
                f"{g['av_on_frontier']}"
            )
    return "\n".join(lines) + "\n"


def scrape_estimator(metrics_url: str) -> dict[str, float]:
    """The server's av_* gauges and counters (coefficients, calibration, token counts)."""
    samples = scrape(metrics_url)
    out = {}
    for (name, labels), value in sorted(samples.items(), key=lambda kv: kv[0][0]):
        if name.startswith("av_") and not name.startswith("av_step_batch_size"):
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels))
            out[f"{name}{{{suffix}}}" if suffix else name] = value
    return out


def start_server(stack: ExitStack, args: argparse.Namespace) -> tuple[str, str]:
    """Start a server on a copy of --model-repository (snapshot in --out); return its URLs."""
    from avspec.runtime.head import is_head_dir
    from avspec.serving.host.host_costs import resolve_for_repository
    from avspec.serving.host.served_repository import head_overrides
    from avspec.serving.host.server_process import ServerProcess, free_port
    from avspec.serving.host.settings import ServeSettings
    from avspec.serving.repository import copy_repository

    work = args.out / "server"
    snapshot = work / "estimator_snapshot.json"
    if work.exists():
        import shutil

        shutil.rmtree(work)
    overrides: dict[str, dict[str, object]] = {"verifier": {"snapshot_path": snapshot}}
    if args.cost_tables is not None:
        overrides["verifier"]["cost_tables"] = args.cost_tables.resolve()
    if args.step_log:
        overrides["verifier"]["step_log"] = (work / "step_log.jsonl").resolve()
    for model, directory in (("target", args.target_dir), ("draft", args.draft_dir)):
        if directory is not None:
            overrides[model] = {"model_dir": directory.resolve()}
    for stage in ("target", "draft"):  # the stages' `dtype` (e.g. w8a8, int4) and engine
        if getattr(args, f"{stage}_dtype", None):
            overrides.setdefault(stage, {})["dtype"] = getattr(args, f"{stage}_dtype")
        if getattr(args, "engine", None):
            overrides.setdefault(stage, {})["engine"] = args.engine
    if args.draft_dir is not None and is_head_dir(args.draft_dir):
        print(head_overrides(overrides), flush=True)  # as the launcher serves a head
    for line in resolve_for_repository(args.model_repository, overrides):
        print(line, flush=True)  # this host's cost tables, as the launcher gives them
    repo = copy_repository(args.model_repository, work / "model_repository", overrides)
    ports = [free_port() for _ in range(3)]
    server = ServerProcess(ServeSettings.for_repository(repo, ports, work / "tritonserver.log"))
    stack.enter_context(server)
    return server.grpc_url, server.metrics_url


def add_server_arguments(p: argparse.ArgumentParser, dtype_help: str = "") -> None:
    """The server a benchmark talks to (`--url`) or starts (`start_server`'s arguments)."""
    p.add_argument("--url", default="127.0.0.1:8001", help="gRPC address of a running server")
    p.add_argument("--start-server", action="store_true", help="start one (free ports)")
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--cost-tables", type=Path, default=None, help="verifier cost tables JSON")
    p.add_argument("--target-dir", type=Path, default=None, help="with --start-server")
    p.add_argument("--draft-dir", type=Path, default=None, help="with --start-server")
    p.add_argument(
        "--target-dtype", default=None, choices=SERVING_DTYPES["cpu"],
        help="with --start-server: the target stage's dtype "
        + (dtype_help or "(default: the repository's)"),
    )  # fmt: skip
    p.add_argument(
        "--draft-dtype", default=None, choices=SERVING_DTYPES["cpu"],
        help="with --start-server: the draft stage's dtype (default: the repository's)",
    )  # fmt: skip
    p.add_argument(
        "--engine", default=None, choices=("auto", "torch", "llamacpp"),
        help="with --start-server: both stages' runtime (a draft head's stays torch; default: "
        "the repository's)",
    )  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = doc_parser(__doc__)
    add_server_arguments(p)
    p.add_argument("--metrics-url", default=None, help="scrape av_* metrics at the end")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma list")
    p.add_argument("--kmax", type=int, default=8, help="the server's max_draft_tokens")
    p.add_argument("--arms", default="default", help="default or none,k<N>,av<N>,...")
    p.add_argument("--workloads", default="code,prose,high_entropy", help="comma list")
    p.add_argument("--workload-dir", type=Path, default=ROOT / "workloads")
    p.add_argument("--prompts", type=int, default=64, help="prompts per workload (cycled)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--max-prompt-tokens", type=int, default=None,
        help="skip prompts longer than this (prompt + max_tokens + kmax must fit max_context)",
    )  # fmt: skip
    p.add_argument(
        "--tokenizer", type=Path, default=ROOT / "models" / "target",
        help="the model directory whose tokenizer counts --max-prompt-tokens",
    )  # fmt: skip
    p.add_argument(
        "--ignore-eos", action="store_true",
        help="every answer runs to --max-tokens (the same work in every arm, whatever it samples)",
    )  # fmt: skip
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=2, help="alternations of the arms per point")
    p.add_argument("--requests-per-user", type=int, default=2, help="per phase, x concurrency")
    p.add_argument("--min-requests", type=int, default=4, help="per phase at least")
    p.add_argument("--warmup-requests", type=int, default=64, help="AV requests, not measured")
    p.add_argument("--request-timeout", type=float, default=300.0, help="s without a response")
    p.add_argument(
        "--step-log", action="store_true",
        help="with --start-server: the verifier logs every step to OUT/server/step_log.jsonl (each "
        "point keeps its phases' wall-clock windows) for client/replay_steps.py",
    )  # fmt: skip
    p.add_argument("--out", type=Path, required=True, help="output directory")
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c})
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.concurrency or min(args.concurrency) < 1 or not args.workloads:
        p.error("need concurrency values >= 1 and at least one workload")
    args.arm_list = arms_or_exit(p, args.arms, args.kmax)
    return args


def arms_or_exit(parser: argparse.ArgumentParser, spec: str, kmax: int) -> list[Arm]:
    """`parse_arms`, a bad spec ending the program through the parser's error."""
    try:
        return parse_arms(spec, kmax)
    except ValueError as err:
        parser.error(str(err))


def take_arms(args: argparse.Namespace) -> list[Arm]:
    """The arms `parse_args` parsed, taken out of `args` (whose fields go into points.json)."""
    arms: list[Arm] = args.arm_list
    del args.arm_list
    return arms


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms = take_arms(args)
    with ExitStack() as stack:
        url, metrics_url = args.url, args.metrics_url
        if args.start_server:
            url, metrics_url = start_server(stack, args)
        client = StreamClient(url, args)
        stack.callback(client.close)
        start = time.monotonic()

        def partial(points: list[dict]) -> None:
            args.elapsed_s = round(time.monotonic() - start, 1)
            write_outputs(args.out, args, arms, points)

        points = sweep(client, args, arms, metrics_url, partial)
        elapsed = time.monotonic() - start
        args.server_metrics = scrape_estimator(metrics_url) if metrics_url else {}
        args.elapsed_s = round(elapsed, 1)
        print(write_outputs(args.out, args, arms, points), end="")
        print(f"wrote {args.out} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
