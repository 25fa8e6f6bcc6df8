#!/usr/bin/env python3
"""Streaming latency through the OpenAI API, with the official `openai` client.

Each of `concurrency` users runs a closed loop (its next request as soon as the previous one
ends) of streamed requests (`stream=True`, `stream_options={"include_usage": True}`) to
`/v1/chat/completions` (the workload prompt as one user message) or `/v1/completions`, all
users on one `AsyncOpenAI` client (pooled keep-alive connections). Request i of a phase uses
prompt i (cycled over `--prompts` evenly spaced prompts of each workload, interleaved) and seed
`--seed + i` (`--same-seed`: `--seed` for all, as a tool that sends one body, AIPerf, does).
Concurrency levels run in `--rounds` rounds, alternating, after an unmeasured warm-up.

Reported as AIPerf defines them (avspec.tools.bench.stream_metrics): time to first token,
inter-token latency (decode time / (output tokens - 1), tokens from the usage), inter-chunk latency
(gaps between content chunks: speculative decoding sends an accepted block of drafts plus the
target's token in one chunk, so ICL is about ITL times the tokens per chunk), output tokens/s per
user (1 / ITL) and in aggregate, request throughput; and the speculative figures the responses carry
(drafted, verified, accepted tokens, decode steps). Prints a table; writes JSON (`--out`) and one
line per request next to it (`<name>_records.jsonl`).

    .venv/bin/python client/bench_openai.py --start-server --chat-template client/chatml.jinja \
        --concurrency 1,4,16 --requests 48 --rounds 3 --max-tokens 32  # bench/openai/chat.json
    .venv/bin/python client/bench_openai.py --url http://127.0.0.1:8000 --endpoint completions
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shutil
import sys
import time
from collections.abc import AsyncIterable, Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai

from avspec.tools.bench.stream_metrics import StreamRecord, combine_rounds, summarize
from avspec.tools.script import doc_parser
from avspec.tools.train.prefixes import even_pick

ROOT = Path(__file__).resolve().parents[1]
MODEL = "speculative"


def load_prompts(directory: Path, workloads: list[str], count: int) -> list[str]:
    """`count` evenly spaced prompts of each workload's JSONL, interleaved workload by workload."""
    sets = []
    for workload in workloads:
        lines = (directory / f"{workload}.jsonl").read_text(encoding="utf-8").splitlines()
        prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
        sets.append(even_pick(prompts, count))
    return [prompt for group in zip(*sets, strict=False) for prompt in group]


async def consume_stream(
    stream: AsyncIterable[Any],
    record: StreamRecord,
    chat: bool,
    clock: Callable[[], float] = time.perf_counter,
) -> StreamRecord:
    """Fill `record` from a stream of chunks: the arrival time of each content chunk (non-empty
    text) and the tokens it completed (the `speculative.tokens` of the steps since the previous
    content chunk: a step whose text the server held back has tokens but no text), the usage and
    the request's speculative totals from the usage chunk."""
    tokens = 0
    async for chunk in stream:
        now = clock()
        figures = (chunk.model_extra or {}).get("speculative") or {}
        if chunk.choices:
            tokens += len(figures.get("tokens", ()))
            choice = chunk.choices[0]
            if choice.delta.content if chat else choice.text:
                record.chunk_times.append(now)
                record.chunk_tokens.append(tokens)
                tokens = 0
        elif chunk.usage is not None:
            record.output_tokens = chunk.usage.completion_tokens
            for key in ("drafted", "verified", "accepted"):
                setattr(record, key, int(figures.get(f"{key}_tokens", 0)))
            record.steps = int(figures.get("steps", 0))
    return record


async def stream_one(
    client: openai.AsyncOpenAI, args: argparse.Namespace, prompt: str, seed: int
) -> StreamRecord:
    """One streamed request; an API or connection error is kept in `record.error`."""
    chat = args.endpoint == "chat"
    options: dict[str, Any] = {
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": args.extra_body or None,
    }
    record = StreamRecord(sent=time.perf_counter())
    try:
        if chat:
            messages = [{"role": "user", "content": prompt}]
            stream = await client.chat.completions.create(messages=messages, **options)
        else:
            stream = await client.completions.create(prompt=prompt, **options)
        async with stream:
            await consume_stream(stream, record, chat)
    except openai.OpenAIError as err:
        record.error = f"{type(err).__name__}: {err}"
    return record


async def run_phase(
    client: openai.AsyncOpenAI,
    args: argparse.Namespace,
    prompts: list[str],
    concurrency: int,
    count: int,
) -> list[StreamRecord]:
    """`concurrency` closed-loop users until `count` requests are done (request i: prompt i,
    seed `--seed + i`, or `--seed` with `--same-seed`)."""
    indices = iter(range(count))  # shared: each user takes the next request when it is free
    records: list[StreamRecord] = []

    async def user() -> None:
        for i in indices:
            seed = args.seed if args.same_seed else args.seed + i
            records.append(await stream_one(client, args, prompts[i % len(prompts)], seed))

    await asyncio.gather(*(user() for _ in range(concurrency)))
    return records


async def sweep(args: argparse.Namespace, base_url: str) -> list[dict[str, Any]]:
    """Warm-up, then every (round, concurrency) phase; one entry per phase."""
    prompts = load_prompts(args.workload_dir, args.workloads, args.prompts)
    phases = []
    async with openai.AsyncOpenAI(
        base_url=base_url, api_key="unused", max_retries=0, timeout=args.request_timeout
    ) as client:
        if args.warmup_requests:
            warm = await run_phase(
                client, args, prompts, max(args.concurrency), args.warmup_requests
            )
            failed = [r.error for r in warm if r.error]
            if failed:
                raise SystemExit(f"warm-up: {len(failed)} requests failed, e.g. {failed[0]}")
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                started = time.monotonic()
                records = await run_phase(client, args, prompts, concurrency, args.requests)
                summary = summarize(records)
                print(
                    f"round {round_index + 1} concurrency {concurrency}: {summary['requests']} "
                    f"requests, {summary['errors']} errors, {summary['empty']} without content, "
                    f"{time.monotonic() - started:.1f} s",
                    file=sys.stderr,
                )
                phases.append(
                    {
                        "round": round_index,
                        "concurrency": concurrency,
                        "summary": summary,
                        "records": [r.to_dict() for r in records],
                    }
                )
    return phases


def combined(phases: list[dict[str, Any]]) -> dict[int, dict[str, dict[str, float]]]:
    """Per concurrency, each figure's median, min and max over the rounds."""
    levels = sorted({p["concurrency"] for p in phases})
    return {
        c: combine_rounds([p["summary"] for p in phases if p["concurrency"] == c]) for c in levels
    }


COLUMNS = (  # (header, figure, format)
    ("req", "requests", "{:.0f}"),
    ("err", "errors", "{:.0f}"),
    ("empty", "empty", "{:.0f}"),
    ("TTFT p50", "ttft_ms_median", "{:.1f}"),
    ("TTFT p99", "ttft_ms_p99", "{:.1f}"),
    ("ITL p50", "itl_ms_median", "{:.2f}"),
    ("ITL 1st", "itl_first_chunk_ms_median", "{:.2f}"),
    ("ICL p50", "icl_ms_median", "{:.2f}"),
    ("ICL mean", "icl_ms_mean", "{:.2f}"),
    ("tok/chunk", "tokens_per_chunk", "{:.2f}"),
    ("tok/s/user", "tokens_per_s_per_user_median", "{:.1f}"),
    ("out tok/s", "output_tokens_per_s", "{:.1f}"),
    ("req/s", "requests_per_s", "{:.2f}"),
    ("acc/ver", "acceptance_rate", "{:.2f}"),
    ("acc/draft", "accepted_per_drafted", "{:.2f}"),
)


def table(levels: dict[int, dict[str, dict[str, float]]], rounds: int) -> str:
    """The figures per concurrency (ms; medians over requests or chunks, then over rounds;
    with several rounds a second line per level gives each figure's range over them)."""
    rows = [["conc", *(header for header, _, _ in COLUMNS)]]
    for concurrency, figures in levels.items():
        medians, ranges = [str(concurrency)], [""]
        for _, key, fmt in COLUMNS:
            median, low, high = (
                fmt.format(figures.get(key, {}).get(which, math.nan))
                for which in ("median", "min", "max")
            )
            medians.append(median)
            ranges.append(f"{low}-{high}")
        rows += [medians, ranges] if rounds > 1 else [medians]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [" ".join(f"{cell:>{w}}" for cell, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def start_server(stack: ExitStack, args: argparse.Namespace) -> str:
    """Start a server on a copy of --model-repository in `<out dir>/server` (free ports); with
    --chat-template, its target is a copy of the target directory with that template as
    `chat_template.jinja`. Returns the front's HTTP URL."""
    from avspec.serving.host.host_costs import resolve_for_repository
    from avspec.serving.host.server_process import ServerProcess, free_port
    from avspec.serving.host.settings import ServeSettings
    from avspec.serving.repository import copy_repository

    work = args.out.parent / "server"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    target = args.target_dir
    if args.chat_template is not None:
        source = target or ROOT / "models" / "target"
        target = work / "target"
        shutil.copytree(source, target)
        shutil.copyfile(args.chat_template, target / "chat_template.jinja")
    overrides: dict[str, dict[str, object]] = {
        "verifier": {"snapshot_path": work / "estimator_snapshot.json"}
    }
    for model, directory in (("target", target), ("draft", args.draft_dir)):
        if directory is not None:
            overrides[model] = {"model_dir": Path(directory).resolve()}
    for line in resolve_for_repository(args.model_repository, overrides):
        print(line, flush=True)  # this host's cost tables, as the launcher gives them
    repository = copy_repository(args.model_repository, work / "model_repository", overrides)
    ports = [free_port() for _ in range(3)]
    log = work / "tritonserver.log"
    server = ServerProcess(ServeSettings.for_repository(repository, ports, log))
    stack.enter_context(server)
    return server.http_url


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module doc); `--concurrency` and `--workloads` as lists."""
    p = doc_parser(__doc__)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the front's public HTTP")
    p.add_argument("--start-server", action="store_true", help="start one on free ports")
    p.add_argument("--model-repository", type=Path, default=ROOT / "model_repository")
    p.add_argument("--target-dir", type=Path, default=None, help="with --start-server")
    p.add_argument("--draft-dir", type=Path, default=None, help="with --start-server")
    p.add_argument(
        "--chat-template",
        type=Path,
        default=None,
        help="with --start-server: serve a copy of the target with this chat template "
        "(client/chatml.jinja: the shipped pair has none, and chat answers 400 without one)",
    )
    p.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    p.add_argument("--model", default=MODEL)
    p.add_argument("--concurrency", default="1,4,16", help="comma list")
    p.add_argument("--requests", type=int, default=32, help="per phase")
    p.add_argument("--rounds", type=int, default=1, help="alternations of the levels")
    p.add_argument("--warmup-requests", type=int, default=16, help="not measured")
    p.add_argument("--workloads", default="code,prose", help="comma list")
    p.add_argument("--workload-dir", type=Path, default=ROOT / "workloads")
    p.add_argument("--prompts", type=int, default=32, help="per workload (cycled)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="request i: seed + i")
    p.add_argument(
        "--same-seed",
        action="store_true",
        help="every request uses --seed (as AIPerf's, which send one body: all requests then "
        "share their random draws, so acceptance is one sample, not one per request)",
    )
    p.add_argument(
        "--extra-body",
        type=json.loads,
        default={},
        help="JSON merged into every request, e.g. '{\"adaptive_verification\": false}'",
    )
    p.add_argument("--request-timeout", type=float, default=300.0, help="s per request")
    p.add_argument("--out", type=Path, default=None, help="JSON (bench/openai/<endpoint>.json)")
    args = p.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency: a comma list of integers, got {args.concurrency!r}")
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not args.concurrency or min(args.concurrency) < 1 or not args.workloads:
        p.error("need concurrency values >= 1 and at least one workload")
    if args.requests < 1 or args.rounds < 1 or args.max_tokens < 1:
        p.error("--requests, --rounds and --max-tokens must be >= 1")
    if args.chat_template is not None and not args.start_server:
        p.error("--chat-template needs --start-server")
    if args.out is None:
        args.out = ROOT / "bench" / "openai" / f"{args.endpoint}.json"
    return args


def records_path(out: Path) -> Path:
    """Where the per-request records go: `<out stem>_records.jsonl` next to `out`."""
    return out.with_name(f"{out.stem}_records.jsonl")


def write_outputs(
    args: argparse.Namespace,
    url: str,
    elapsed: float,
    levels: dict[int, dict[str, dict[str, float]]],
    phases: list[dict[str, Any]],
) -> None:
    """`--out`: the configuration, the figures per level and per phase; next to it one line
    per request (round, concurrency, chunk arrival ms after sending, tokens, counts)."""
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {
        "config": {**config, "url": url, "elapsed_s": round(elapsed, 1)},
        "combined": levels,
        "phases": [{k: v for k, v in p.items() if k != "records"} for p in phases],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n")
    lines = [
        json.dumps({"round": p["round"], "concurrency": p["concurrency"], **record})
        for p in phases
        for record in p["records"]
    ]
    records_path(args.out).write_text("".join(line + "\n" for line in lines))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with ExitStack() as stack:
        url = start_server(stack, args) if args.start_server else args.url
        started = time.monotonic()
        phases = asyncio.run(sweep(args, url.rstrip("/") + "/v1"))
        elapsed = time.monotonic() - started
    levels = combined(phases)
    write_outputs(args, url, elapsed, levels, phases)
    print(
        f"bench_openai: /v1/{'chat/' if args.endpoint == 'chat' else ''}completions, stream, "
        f"max_tokens {args.max_tokens}, temperature {args.temperature}, top-p {args.top_p}, "
        f"{args.requests} requests per level x {args.rounds} rounds; ms"
    )
    print(table(levels, args.rounds))
    print(f"wrote {args.out} and {records_path(args.out)} in {elapsed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
