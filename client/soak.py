"""Soak test: hold N concurrent client loops against the `speculative` model; watch memory.

Each of --concurrency loops sends one request after another until --duration-s is up (warm-up
included). The mix: gRPC streaming (tritonclient.grpc, one long-lived stream per loop) half of
the time, HTTP /generate and /generate_stream (urllib) a quarter each; prompts from
workloads/*.jsonl; max_tokens uniform in --max-tokens; temperature 0, 0.7 or 1; num_draft_tokens
0 or 4 for a quarter of the requests each, else the server's default. --cancel-fraction of the
streaming requests are cancelled by the client after 1-3 responses (the gRPC stream is stopped,
the HTTP connection closed). A request is ok, cancelled, or failed (error text kept).

Every --sample-s it samples VmRSS of tritonserver and of each Python-backend stub (one per model,
children of the server) and the total size of the files in /dev/shm. Growth per process = last
sample / first sample after --warmup-s - 1. Plateau: the growth over the first and over the last
third of the post-warm-up samples (least-squares slope x the third's length / mean level); a
process has plateaued when its last-third growth is under a quarter of its first-third growth
or under 1%.

Exit status 1 if any request failed (cancelled ones are not failures), any process grew by
>= --max-growth after warm-up, a stub was restarted, sequences were still live 30 s after the
load stopped (--metrics-url), or (--start-server) one of the server's /dev/shm regions was left
behind. Writes --out/soak.json (config, counts, errors, memory series, growth, shm),
memory.png (RSS per process over time, warm-up shaded) and summary.txt.

    python client/soak.py --start-server --duration-s 600 --concurrency 64 --out bench/soak
    python client/soak.py --grpc-url 127.0.0.1:8001 --http-url http://127.0.0.1:8000 \\
        --metrics-url http://127.0.0.1:8002/metrics --server-pid "$(pgrep -n tritonserver)" \\
        --duration-s 120 --warmup-s 30 --out /tmp/soak
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from contextlib import ExitStack
from pathlib import Path

from tqdm import tqdm

from avspec.serving.host.server_process import ServerProcess, free_port
from avspec.serving.host.settings import ServeSettings
from avspec.tools.bench.soak.drain import wait_drained
from avspec.tools.bench.soak.load import Endpoints, Tally, join_loops, start_loops
from avspec.tools.bench.soak.memory import (
    SHM_DIR,
    MemorySampler,
    cmdline,
    find_tritonserver,
    repository_from_cmdline,
    shm_after_stop,
    shm_usage,
)
from avspec.tools.bench.soak.mix import Mix, load_prompts
from avspec.tools.bench.soak.report import build_result, write_outputs
from avspec.tools.script import doc_parser

ROOT = Path(__file__).resolve().parents[1]
JOIN_GRACE_S = 30.0  # on top of --request-timeout, for the requests in flight at the deadline


def run_soak(
    endpoints: Endpoints,
    mix: Mix,
    args: argparse.Namespace,
    sampler: MemorySampler | None,
    tally: Tally,
) -> dict:
    """Run the loops for args.duration_s with a progress line; the run's part of soak.json."""
    start = time.monotonic()
    deadline = start + args.duration_s
    if sampler is not None:
        sampler.start = start
        sampler.start_thread()
    threads = start_loops(
        args.concurrency, endpoints, mix, tally, deadline, args.seed, args.request_timeout
    )
    _progress(deadline, args.duration_s, tally, sampler)
    # in-flight requests finish (or time out) after the deadline; one wait for all of them
    stuck = join_loops(threads, args.request_timeout + JOIN_GRACE_S)
    elapsed = time.monotonic() - start
    if sampler is not None:
        sampler.stop()
    live, live_error = {}, None
    if endpoints.metrics_url:
        try:
            live = wait_drained(endpoints.metrics_url, args.drain_timeout_s)
        except OSError as err:  # URLError included: the server died under the load
            live_error = f"metrics unreachable after the load: {err}"
    return {
        "elapsed_s": round(elapsed, 1),
        "stuck_loops": stuck,
        "live_after_load": live,
        "live_error": live_error,
    }


def _progress(
    deadline: float, duration_s: float, tally: Tally, sampler: MemorySampler | None
) -> None:
    """A tqdm line, one tick a second, until `deadline`."""
    with tqdm(total=round(duration_s), desc="soak", unit="s", file=sys.stderr) as bar:
        while (left := deadline - time.monotonic()) > 0:
            time.sleep(min(1.0, left))
            bar.n = min(round(duration_s - max(0.0, deadline - time.monotonic())), bar.total)
            postfix = (
                f"ok={tally.total('ok')} failed={tally.total('failed')} "
                f"cancelled={tally.total('cancelled')}"
            )
            if sampler is not None and sampler.samples:
                rss = sampler.samples[-1]["rss_mib"]
                postfix += " " + " ".join(f"{n}={v:.0f}M" for n, v in rss.items())
            bar.set_postfix_str(postfix, refresh=False)
            bar.refresh()


def start_server(stack: ExitStack, args: argparse.Namespace) -> ServerProcess:
    """Start a server on a copy of --model-repository (log and snapshot in --out/server)."""
    # imported here: it pulls in torch, which only --start-server needs (--help stays quick)
    from avspec.serving.host.host_costs import resolve_for_repository
    from avspec.serving.repository import copy_repository

    work = args.out / "server"
    if work.exists():
        shutil.rmtree(work)
    # the estimator snapshot goes to the copy: a soak must not overwrite the deployed one
    overrides = {"verifier": {"snapshot_path": work / "estimator_snapshot.json"}}
    for line in resolve_for_repository(args.model_repository, overrides):
        print(line, flush=True)  # this host's cost tables, as the launcher gives them
    repo = copy_repository(args.model_repository, work / "model_repository", overrides)
    ports = [free_port() for _ in range(3)]
    server = ServerProcess(ServeSettings.for_repository(repo, ports, work / "tritonserver.log"))
    stack.enter_context(server)
    return server


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = doc_parser(__doc__)
    p.add_argument("--start-server", action="store_true", help="start one on free ports")
    p.add_argument(
        "--model-repository",
        type=Path,
        default=None,
        help="with --start-server (default model_repository/); else where the "
        "stubs' model.py files live (default: from the server's command line)",
    )
    p.add_argument("--grpc-url", default="127.0.0.1:8001")
    p.add_argument("--http-url", default="http://127.0.0.1:8000")
    p.add_argument("--metrics-url", default=None, help="checks that sequences drain at the end")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="tritonserver's pid (or its launcher's) for memory sampling",
    )
    p.add_argument("--concurrency", type=int, default=64, help="client loops")
    p.add_argument("--duration-s", type=float, default=600.0, help="load time, warm-up included")
    p.add_argument("--warmup-s", type=float, default=60.0, help="excluded from memory growth")
    p.add_argument("--sample-s", type=float, default=5.0, help="memory sampling interval")
    p.add_argument("--max-growth", type=float, default=0.10, help="RSS growth that fails")
    p.add_argument("--max-tokens", default="16,64", help="MIN,MAX of max_tokens (uniform)")
    p.add_argument(
        "--max-context",
        type=int,
        default=512,
        help="the server's max_context: longer prompts are skipped",
    )
    p.add_argument("--kmax", type=int, default=8, help="the server's max_draft_tokens")
    p.add_argument("--cancel-fraction", type=float, default=0.03, help="of streaming requests")
    p.add_argument("--workload-dir", type=Path, default=ROOT / "workloads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0, help="s without a response")
    p.add_argument(
        "--drain-timeout-s",
        type=float,
        default=30.0,
        help="wait this long for live sequences to reach 0 after the load",
    )
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "soak")
    args = p.parse_args(argv)
    try:
        low, high = (int(x) for x in args.max_tokens.split(","))
    except ValueError:
        p.error(f"--max-tokens wants MIN,MAX, got {args.max_tokens!r}")
    if not 1 <= low <= high:
        p.error(f"--max-tokens wants 1 <= MIN <= MAX, got {args.max_tokens!r}")
    args.token_range = (low, high)
    if args.concurrency < 1 or args.duration_s <= 0 or args.sample_s <= 0:
        p.error("need --concurrency >= 1, --duration-s > 0 and --sample-s > 0")
    if not 0 <= args.cancel_fraction <= 1:
        p.error("--cancel-fraction must lie in [0, 1]")
    return args


def _config(args: argparse.Namespace) -> dict:
    """soak.json's config: every option, paths as text, max_tokens as [MIN, MAX]."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    config["max_tokens"] = list(config.pop("token_range"))
    return config


def main(argv: list[str] | None = None) -> int:
    """Run the soak; 0 if it passed, 1 if it failed (summary's FAIL line), 2 without prompts."""
    args = parse_args(argv)
    budget = args.max_context - args.token_range[1] - args.kmax  # what a prompt may take
    prompts = load_prompts(args.workload_dir, budget)
    if not prompts:
        print(f"soak: no prompt of at most {budget} tokens in {args.workload_dir}", file=sys.stderr)
        return 2
    mix = Mix(prompts, *args.token_range, args.cancel_fraction)
    tally = Tally()
    shm_before = shm_usage()
    shm = None
    with ExitStack() as stack:
        if args.start_server:
            args.model_repository = args.model_repository or ROOT / "model_repository"
            server = start_server(stack, args)
            endpoints = Endpoints(server.grpc_url, server.http_url, server.metrics_url)
            server_pid, repository = server.process.pid, server.model_repository  # the copy
        else:
            endpoints = Endpoints(args.grpc_url, args.http_url, args.metrics_url)
            server_pid, repository = args.server_pid, args.model_repository
        sampler = _sampler(server_pid, repository, tally, args)
        run = run_soak(endpoints, mix, args, sampler, tally)
    if args.start_server:  # the ExitStack stopped the server
        shm = shm_after_stop(shm_before, sampler.regions if sampler else set())
    result = build_result(_config(args), tally, run, sampler, shm, args.warmup_s, args.max_growth)
    print(write_outputs(args.out, result), end="")
    print(f"wrote {args.out}")
    return 1 if result["failures"] else 0


def _sampler(
    server_pid: int | None, repository: Path | None, tally: Tally, args: argparse.Namespace
) -> MemorySampler | None:
    """A sampler of the server's memory (None without a pid); the repository locates its stubs."""
    if server_pid is None:
        return None
    pid = find_tritonserver(server_pid)
    if repository is None:
        repository = repository_from_cmdline(cmdline(pid))
        if repository is None:
            raise SystemExit(f"soak: no --model-repository in tritonserver {pid}'s command line")
    # the server's own /dev/shm (a private tmpfs in its sandbox), seen through its root
    private = Path(f"/proc/{pid}/root/dev/shm")
    shm_dir = private if os.access(private, os.R_OK | os.X_OK) else SHM_DIR
    return MemorySampler(pid, repository, tally.done, interval_s=args.sample_s, shm_dir=shm_dir)


if __name__ == "__main__":
    sys.exit(main())
