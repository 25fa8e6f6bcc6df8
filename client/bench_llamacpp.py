"""Output tokens/s against llama.cpp's own server: the same GGUF, questions and sampling.

Users compare this server with `llama-server`, so this benchmark does that: llama.cpp's C++
server (the prebuilt `xllamacpp` wheel, in a venv of its own: `--llama-python`; no project
dependency) against a server of this project (`--project-url`, or `--start-project ENGINE`,
which starts `python -m avspec.serving.host.launcher` with that `--engine` and stops it with SIGINT;
`torch,llamacpp` runs one project server after the other, each against the same llama.cpp
server). llama.cpp serves `--gguf` with `--threads` threads (generation and batch), `--slots`
parallel slots with continuous batching, a unified KV cache of slots x `--ctx-per-slot` tokens,
flash attention off (as this project's engine runs; `--flash-attn` turns it on), and, with
`--llama-draft FILE`, its own speculative decoding with that draft GGUF.

Load: client/bench_openai.py's closed-loop streaming users (its `run_phase`), `--concurrency`
of them per level, on `POST /v1/chat/completions`: each of the held-out chat questions
(workloads/chat.jsonl, their `messages`) as the one user message, so each server applies the
model's own chat template. Request i uses question i (cycled) and seed `--seed + i`, on both
sides; `--max-tokens`, no ignore_eos: the generated tokens are counted from each response's
usage, so a side that stops earlier generates fewer. Sampling is `--temperature` and `--top-p`
(`--greedy`: temperature 0); llama.cpp's default chain (top-k 40, min-p 0.05, temperature last)
is replaced by this server's (temperature, then top-p, nothing else) unless
`--llama-default-sampling`. llama.cpp's prompt cache is off (`--llama-cache-prompt` turns it
on): the questions repeat across rounds and levels, and this server has no prefix reuse.

After an unmeasured warm-up of each side at every level, `--rounds` rounds run every level on
both sides, llama.cpp first in even rounds and last in odd ones, so load drift hits both alike.
Figures per level (avspec.tools.bench.stream_metrics): output tokens/s = output tokens / (last
content chunk - first request sent), per-user tokens/s = 1 / inter-token latency, TTFT;
medians over rounds. Each request has a connection of its own, on both sides (see `measure`).

Writes to `--out`: `<side>_c<N>.json` per side and level (figures, rounds, host CPU model and
flags, threads, slots, versions), results.json (everything, with the ratios), records.jsonl
(one line per request), summary.txt (the table of project / llama.cpp per level, also printed),
tokens_per_s.png, and the servers' logs. The venv, once:

    python3.11 -m venv build/xllamacpp-venv && \\
        build/xllamacpp-venv/bin/pip install xllamacpp==2026.10.11549
    .venv/bin/python client/bench_llamacpp.py --start-project torch,llamacpp   # bench/llamacpp
    .venv/bin/python client/bench_llamacpp.py --start-project llamacpp --greedy \\
        --out bench/llamacpp-greedy
    .venv/bin/python client/bench_llamacpp.py --project-url http://127.0.0.1:8000 \\
        --concurrency 1,4 --requests 8 --max-tokens 16 --rounds 1 --out /tmp/bench-llamacpp
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx2  # openai's HTTP client
import openai
from bench_openai import MODEL, combined, run_phase

from avspec.tools.bench.stream_metrics import StreamRecord, summarize
from avspec.tools.script import doc_parser
from avspec.tools.train.prefixes import even_pick

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "llama.cpp"
DEFAULT_LLAMA_PYTHON = ROOT / "build" / "xllamacpp-venv" / "bin" / "python"
XLLAMACPP = "xllamacpp==2026.10.11549"
VENV_HINT = (
    f"python3.11 -m venv build/xllamacpp-venv && build/xllamacpp-venv/bin/pip install {XLLAMACPP}"
)
SERVING_LINE = "avspec: serving"  # what the launcher prints once every model is ready


class BenchError(RuntimeError):
    """A server that is missing, did not start, or failed the warm-up."""


# --- llama.cpp's server -------------------------------------------------------------------


def _llama_server_program() -> None:  # pragma: no cover - runs in the xllamacpp venv
    """The server program (stdlib and xllamacpp only), run there by `python -c`.

    argv[1]: the JSON of `llama_config`. Starts llama.cpp's HTTP server on a free port of
    127.0.0.1, writes one JSON line (its URL, versions, what it was built for), then serves
    until stdin closes. The line goes to a copy of fd 1; fd 1 itself goes to stderr, so that
    nothing llama.cpp prints can break it.
    """
    import json
    import os
    import sys

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import xllamacpp

    config = json.loads(sys.argv[1])
    params = xllamacpp.CommonParams()
    params.model.path = config["gguf"]
    params.n_parallel = config["slots"]
    params.cont_batching = True
    params.n_ctx = config["slots"] * config["ctx_per_slot"]
    unified = hasattr(params, "kv_unified") and not config["kv_split"]
    if hasattr(params, "kv_unified"):
        params.kv_unified = unified  # one pool for all slots, as this project's; or a stream each
    for cpu in (params.cpuparams, params.cpuparams_batch):
        cpu.n_threads = config["threads"]
    kinds = xllamacpp.llama_flash_attn_type
    params.flash_attn_type = (
        kinds.LLAMA_FLASH_ATTN_TYPE_ENABLED
        if config["flash_attn"]
        else kinds.LLAMA_FLASH_ATTN_TYPE_DISABLED
    )
    params.cache_prompt = config["cache_prompt"]
    params.hostnames = ["127.0.0.1"]
    params.port = 0
    if config["project_sampling"]:  # temperature then top-p, as this project's server
        params.sampling.top_k = 0
        params.sampling.min_p = 0.0
        params.sampling.samplers = "temperature;top_p"
    if config["draft"]:
        draft = params.speculative.draft
        draft.mparams.path = config["draft"]
        for cpu in (draft.cpuparams, draft.cpuparams_batch):
            cpu.n_threads = config["threads"]
        if config["draft_max"] is not None:
            draft.n_max = config["draft_max"]
        if config["draft_min"] is not None:
            draft.n_min = config["draft_min"]
        params.speculative.types = [
            xllamacpp.common_speculative_type.COMMON_SPECULATIVE_TYPE_DRAFT_SIMPLE
        ]
    server = xllamacpp.Server(params)
    ready = {
        "url": server.listening_address,
        "xllamacpp": xllamacpp.__version__,
        "build_info": xllamacpp.BUILD_INFO,
        "system_info": xllamacpp.get_system_info(),
        "n_ctx": params.n_ctx,
        "kv_unified": unified,
        "draft_max": params.speculative.draft.n_max if config["draft"] else None,
        "draft_min": params.speculative.draft.n_min if config["draft"] else None,
        "python": sys.version.split()[0],
    }
    proto.write(json.dumps(ready) + "\n")
    sys.stdin.read()  # until the parent closes it
    del server  # waits for the server's loop to exit


SERVER_SOURCE = inspect.getsource(_llama_server_program) + "\n_llama_server_program()\n"


def check_llama_python(path: Path) -> Path:
    """`path` if it is an executable file; BenchError saying how to make the venv if not."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise BenchError(
            f"no xllamacpp interpreter at {path}: create its venv with\n    {VENV_HINT}\n"
            "or pass --llama-python"
        )
    return path


def llama_config(args: argparse.Namespace, gguf: Path) -> dict[str, Any]:
    """What the server program is told (its argv[1], as JSON)."""
    return {
        "gguf": str(gguf),
        "slots": args.slots,
        "ctx_per_slot": args.ctx_per_slot,
        "threads": args.threads,
        "flash_attn": args.flash_attn,
        "kv_split": args.kv_split,
        "cache_prompt": args.llama_cache_prompt,
        "project_sampling": not args.llama_default_sampling,
        "draft": str(args.llama_draft) if args.llama_draft else None,
        "draft_max": args.llama_draft_max,
        "draft_min": args.llama_draft_min,
    }


def log_tail(path: Path, lines: int = 15) -> str:
    """The last `lines` lines of a log, for an error message."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def wait_health(url: str, alive: Any, timeout_s: float) -> None:
    """Poll `url`/health until it answers 200; BenchError if `alive()` turns false or on time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise BenchError(f"the server behind {url} exited")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    raise BenchError(f"{url}/health did not answer within {timeout_s:.0f} s")


class LlamaServer:
    """llama.cpp's server in a subprocess of the xllamacpp venv; a context manager."""

    def __init__(
        self, python: Path, config: dict[str, Any], log_path: Path, timeout_s: float = 300.0
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log: IO[str] = log_path.open("w")
        self.process = subprocess.Popen(
            [str(python), "-c", SERVER_SOURCE, json.dumps(config)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        try:
            self.info: dict[str, Any] = self._ready()
            self.url: str = self.info["url"]
            wait_health(self.url, lambda: self.process.poll() is None, timeout_s)
        except BaseException:
            self.close()
            raise

    def _ready(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(timeout=30)
            self._log.flush()
            raise BenchError(
                f"llama.cpp's server exited with code {code}; {self.log_path}:\n"
                + log_tail(self.log_path)
            )
        return json.loads(line)

    def close(self) -> None:
        """Close its stdin (the program then stops the server) and wait; kill after 30 s."""
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.process.stdout is not None:
            self.process.stdout.close()
        self._log.close()

    def __enter__(self) -> LlamaServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- this project's server ----------------------------------------------------------------


def project_command(args: argparse.Namespace, engine: str, ports: Sequence[int]) -> list[str]:
    """The launcher's command line for `engine` on (HTTP, gRPC, metrics) `ports`."""
    http, grpc, metrics = ports
    return [
        sys.executable, "-m", "avspec.serving.host.launcher",
        "--model-repository", str(args.model_repository.resolve()),
        "--draft-model", str(args.draft_model.resolve()),
        "--target-model", str(args.target_model.resolve()),
        "--engine", engine,
        "--host", "127.0.0.1",
        "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
        *args.project_args,
    ]  # fmt: skip


class ProjectServer:
    """This project's launcher in its own session, its output copied to a log; the context
    manager waits for its `avspec: serving` line and stops it with SIGINT."""

    def __init__(
        self, command: list[str], http_port: int, log_path: Path, timeout_s: float
    ) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self.command = command
        self.url = f"http://127.0.0.1:{http_port}"
        self._serving = threading.Event()
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # a Ctrl-C at the terminal reaches it only through close()
        )
        self._copier = threading.Thread(target=self._copy_output, daemon=True)
        self._copier.start()
        try:
            self._wait_serving(timeout_s)
        except BaseException:
            self.close()
            raise

    def _copy_output(self) -> None:
        assert self.process.stdout is not None
        with self.log_path.open("w") as log:
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if line.startswith(SERVING_LINE):
                    self._serving.set()

    def _wait_serving(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._serving.wait(0.5):
            if self.process.poll() is not None:
                self._copier.join(timeout=5)
                raise BenchError(
                    f"the project's server exited with code {self.process.returncode}; "
                    f"{self.log_path}:\n{log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise BenchError(f"no '{SERVING_LINE}' within {timeout_s:.0f} s: {self.log_path}")

    def close(self) -> None:
        """SIGINT, then SIGKILL to its process group after 120 s."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._copier.join(timeout=10)

    def __enter__(self) -> ProjectServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- load ---------------------------------------------------------------------------------


@dataclass
class Side:
    """One server under load: its name in the results, URL, model name and description."""

    name: str
    url: str
    model: str
    about: dict[str, Any]


def load_questions(path: Path, count: int) -> list[str]:
    """The user message of `count` evenly spaced conversations of a workload JSONL (all of
    them if it has fewer); each server renders it with the model's chat template."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    questions = []
    for line in lines:
        users = [m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"]
        questions.append(users[-1])
    return even_pick(questions, count)


def client_args(args: argparse.Namespace, model: str) -> argparse.Namespace:
    """The namespace bench_openai's `run_phase` reads, for one side."""
    return argparse.Namespace(
        endpoint="chat",
        model=model,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        same_seed=False,
        extra_body={},
        request_timeout=args.request_timeout,
    )


async def _phase(
    side: Side, args: argparse.Namespace, questions: list[str], concurrency: int, count: int
) -> list[StreamRecord]:
    limits = httpx2.Limits(max_connections=1000, max_keepalive_connections=0)
    async with openai.AsyncOpenAI(
        base_url=side.url.rstrip("/") + "/v1",
        api_key="unused",
        max_retries=0,
        timeout=args.request_timeout,
        http_client=openai.DefaultAsyncHttpxClient(limits=limits),
    ) as client:
        return await run_phase(client, client_args(args, side.model), questions, concurrency, count)


def measure(
    side: Side, args: argparse.Namespace, questions: list[str], concurrency: int, count: int
) -> list[StreamRecord]:
    """`count` requests from `concurrency` closed-loop users of `side` (bench_openai), each on
    a connection of its own: llama.cpp's server now and then closes a kept-alive connection
    just as the next request goes out on it ('Server disconnected without sending a
    response'), an error with no retries; a new local connection costs well under 1 ms."""
    return asyncio.run(_phase(side, args, questions, concurrency, count))


def requests_for(args: argparse.Namespace, concurrency: int) -> int:
    """Requests per phase: `--requests`, or 4 per user (at least 16)."""
    return args.requests if args.requests else max(16, 4 * concurrency)


def warm_up(side: Side, args: argparse.Namespace, questions: list[str]) -> None:
    """Unmeasured requests at every level (each batch size a server may first meet there),
    `--warmup-requests` per level or one per user; BenchError if any fails."""
    for concurrency in args.concurrency:
        count = concurrency if args.warmup_requests is None else args.warmup_requests
        records = measure(side, args, questions, concurrency, count) if count else []
        failed = [r.error for r in records if r.error]
        if failed:
            raise BenchError(
                f"{side.name} warm-up: {len(failed)} requests failed, e.g. {failed[0]}"
            )


def prompt_tokens(side: Side, question: str, timeout_s: float) -> int | None:
    """The prompt tokens `side` reports for `question` (one token generated): equal on both
    sides when both render the same chat template with the same tokenizer."""
    with openai.OpenAI(
        base_url=side.url.rstrip("/") + "/v1", api_key="unused", max_retries=0, timeout=timeout_s
    ) as client:
        try:
            response = client.chat.completions.create(
                model=side.model,
                messages=[{"role": "user", "content": question}],
                max_tokens=1,
                temperature=0.0,
            )
        except openai.OpenAIError:
            return None
    return response.usage.prompt_tokens if response.usage else None


def round_plan(rounds: int) -> list[tuple[int, bool]]:
    """(round, llama.cpp?) in run order: llama.cpp first in even rounds, last in odd ones."""
    return [(r, llama) for r in range(rounds) for llama in ((True, False), (False, True))[r % 2]]


def run_pairing(
    llama: Side, project: Side, args: argparse.Namespace, questions: list[str]
) -> list[dict[str, Any]]:
    """Warm both sides up, then the alternating rounds; one entry per (side, round, level)."""
    for side in (llama, project):
        warm_up(side, args, questions)
    phases = []
    for round_index, llama_turn in round_plan(args.rounds):
        side = llama if llama_turn else project
        for concurrency in args.concurrency:
            started = time.monotonic()
            records = measure(side, args, questions, concurrency, requests_for(args, concurrency))
            summary = summarize(records)
            print(
                f"[bench_llamacpp] {project.name}: {side.name} round {round_index + 1} "
                f"concurrency {concurrency}: {summary.get('output_tokens_per_s', math.nan):.1f} "
                f"tok/s, {summary['errors']} errors, {time.monotonic() - started:.1f} s",
                file=sys.stderr,
                flush=True,
            )
            phases.append(
                {
                    "pairing": project.name,
                    "side": side.name,
                    "round": round_index,
                    "concurrency": concurrency,
                    "summary": summary,
                    "records": [r.to_dict() for r in records],
                }
            )
    return phases


# --- figures ------------------------------------------------------------------------------


def _figure(levels: dict[int, dict[str, dict[str, float]]], c: int, key: str) -> float:
    """The median over rounds of one figure at level `c` (NaN where it is missing)."""
    return levels.get(c, {}).get(key, {}).get("median", math.nan)


def _divide(a: float, b: float) -> float:
    return a / b if b and not math.isnan(a) and not math.isnan(b) else math.nan


def ratio_rows(phases: list[dict[str, Any]], pairing: str) -> list[dict[str, float]]:
    """Per level of one pairing: both sides' medians over rounds (tokens/s, per-user
    tokens/s, TTFT, tokens per request, errors) and project / llama.cpp tokens/s, as the ratio
    of the medians and the range of the round-by-round ratios."""
    mine = [p for p in phases if p["pairing"] == pairing]
    sides = {s: [p for p in mine if p["side"] == s] for s in (LLAMA, pairing)}
    levels = {s: combined(ps) for s, ps in sides.items()}
    rows = []
    for c in sorted({p["concurrency"] for p in mine}):
        row: dict[str, float] = {"concurrency": c}
        for tag, side in (("llama", LLAMA), ("project", pairing)):
            row[f"{tag}_tokens_per_s"] = _figure(levels[side], c, "output_tokens_per_s")
            row[f"{tag}_per_user"] = _figure(levels[side], c, "tokens_per_s_per_user_median")
            row[f"{tag}_ttft_ms"] = _figure(levels[side], c, "ttft_ms_median")
            row[f"{tag}_tokens_per_request"] = _figure(levels[side], c, "output_tokens_mean")
            row[f"{tag}_errors"] = sum(
                p["summary"]["errors"] for p in sides[side] if p["concurrency"] == c
            )
        row["ratio"] = _divide(row["project_tokens_per_s"], row["llama_tokens_per_s"])
        by_round = {
            s: {
                p["round"]: p["summary"].get("output_tokens_per_s", math.nan)
                for p in sides[s]
                if p["concurrency"] == c
            }
            for s in sides
        }
        paired = [
            _divide(by_round[pairing][r], by_round[LLAMA][r])
            for r in sorted(by_round[pairing])
            if r in by_round[LLAMA]
        ]
        paired = [x for x in paired if not math.isnan(x)]
        row["ratio_min"] = min(paired, default=math.nan)
        row["ratio_max"] = max(paired, default=math.nan)
        rows.append(row)
    return rows


TABLE = (  # (header, row key, format)
    ("conc", "concurrency", "{:.0f}"),
    ("llama tok/s", "llama_tokens_per_s", "{:.1f}"),
    ("project tok/s", "project_tokens_per_s", "{:.1f}"),
    ("x llama", "ratio", "{:.2f}"),
    ("rounds", "ratio_range", "{}"),
    ("llama tok/s/user", "llama_per_user", "{:.1f}"),
    ("project tok/s/user", "project_per_user", "{:.1f}"),
    ("llama TTFT ms", "llama_ttft_ms", "{:.0f}"),
    ("project TTFT ms", "project_ttft_ms", "{:.0f}"),
    ("llama tok/req", "llama_tokens_per_request", "{:.1f}"),
    ("project tok/req", "project_tokens_per_request", "{:.1f}"),
    ("errors", "errors", "{}"),
)


def table(rows: list[dict[str, float]]) -> str:
    """The rows of one pairing, one line per level, right-aligned columns."""
    cells = [[header for header, _, _ in TABLE]]
    for row in rows:
        shown = {
            **row,
            "ratio_range": f"{row['ratio_min']:.2f}-{row['ratio_max']:.2f}",
            "errors": f"{row['llama_errors']:.0f}/{row['project_errors']:.0f}",
        }
        cells.append([fmt.format(shown[key]) for _, key, fmt in TABLE])
    widths = [max(len(line[i]) for line in cells) for i in range(len(TABLE))]
    return "\n".join(
        " ".join(f"{cell:>{w}}" for cell, w in zip(line, widths, strict=True)) for line in cells
    )


def summary_text(
    args: argparse.Namespace, info: dict[str, Any], rows: dict[str, list[dict[str, float]]]
) -> str:
    """The header (settings, host, versions) and one table per pairing."""
    llama, host = info["llama"], info["host"]
    draft = f", draft {args.llama_draft}" if args.llama_draft else ""
    lines = [
        f"bench_llamacpp: /v1/chat/completions, stream, {len(info['questions'])} chat "
        f"questions, max_tokens {args.max_tokens}, temperature {args.temperature}, top-p "
        f"{args.top_p}, {args.rounds} round(s); tok/s = output tokens / wall time, medians "
        "over rounds; 'x llama' = project / llama.cpp (rounds: the range round by round)",
        f"llama.cpp: xllamacpp {llama.get('xllamacpp', '?')}, {args.threads} threads, "
        f"{args.slots} slots, n_ctx {llama.get('n_ctx', '?')} "
        f"({'a stream per slot' if args.kv_split else 'unified'}), flash attention "
        f"{'on' if args.flash_attn else 'off'}, sampling "
        f"{'llama.cpp default' if args.llama_default_sampling else 'temperature;top_p'}, prompt "
        f"cache {'on' if args.llama_cache_prompt else 'off'}{draft}; {args.gguf}",
        f"host: {host['model']}, {host['cpus']} CPUs, {' '.join(host['flags'])}",
    ]
    for pairing, pairing_rows in rows.items():
        tokens = info["prompt_tokens"].get(pairing, {})
        check = (
            "the same"
            if tokens.get(LLAMA) is not None and tokens.get(LLAMA) == tokens.get(pairing)
            else f"DIFFER ({tokens})"
        )
        about = info["projects"].get(pairing, {})
        served = shlex.join(about["command"][3:]) if "command" in about else about.get("url")
        lines += ["", f"{pairing} vs {LLAMA} (prompt tokens of question 0: {check})"]
        lines += [f"{pairing}: {served}", table(pairing_rows)]
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, list[dict[str, float]]], path: Path) -> None:
    """tokens/s against concurrency, a line per side (llama.cpp's dashed, one per pairing)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    several = len(rows) > 1
    for pairing, pairing_rows in rows.items():
        levels = [r["concurrency"] for r in pairing_rows]
        axes.plot(levels, [r["project_tokens_per_s"] for r in pairing_rows], "o-", label=pairing)
        label = f"{LLAMA} (with {pairing})" if several else LLAMA
        axes.plot(levels, [r["llama_tokens_per_s"] for r in pairing_rows], "s--", label=label)
    every = sorted({r["concurrency"] for rs in rows.values() for r in rs})
    axes.set_xscale("log", base=2)
    axes.set_xticks(every, [str(c) for c in every])
    axes.set_ylim(bottom=0)
    axes.set_xlabel("concurrency (closed-loop users)")
    axes.set_ylabel("output tokens/s")
    axes.set_title("output tokens/s: this server and llama.cpp's server")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# --- host and versions --------------------------------------------------------------------


def cpu_info(text: str) -> dict[str, Any]:
    """From the whole of /proc/cpuinfo: the CPU model(s), the logical CPUs, and the vector and
    matrix flags every CPU has (avx*, amx*, fma, f16c): what llama.cpp's kernels depend on."""
    blocks = [b for b in text.split("\n\n") if b.strip()]
    models, flag_sets = set(), []
    for block in blocks:
        fields = dict(
            (k.strip(), v.strip())
            for k, _, v in (line.partition(":") for line in block.splitlines())
        )
        if "model name" in fields:
            models.add(fields["model name"])
        if "flags" in fields:
            flag_sets.append(set(fields["flags"].split()))
    common = set.intersection(*flag_sets) if flag_sets else set()
    wanted = sorted(f for f in common if f.startswith(("avx", "amx")) or f in ("fma", "f16c"))
    return {
        "model": " / ".join(sorted(models)) or platform.processor() or "?",
        "cpus": sum(1 for b in blocks if b.lstrip().startswith("processor")),
        "flags": wanted,
    }


def host_info() -> dict[str, Any]:
    """cpu_info of this host, the CPUs this process may use, and the load average."""
    try:
        info = cpu_info(Path("/proc/cpuinfo").read_text())
    except OSError:
        info = {"model": platform.processor() or "?", "cpus": os.cpu_count(), "flags": []}
    return {
        **info,
        "usable_cpus": len(os.sched_getaffinity(0)),
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "kernel": platform.release(),
    }


def versions() -> dict[str, str]:
    """This project's git commit (with '-dirty' for uncommitted changes), python, openai."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "project": commit or "?",
        "python": platform.python_version(),
        "openai": openai.__version__,
    }


# --- command line and run -----------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module doc); lists split, `--greedy` applied."""
    p = doc_parser(__doc__)
    project = p.add_mutually_exclusive_group(required=True)
    project.add_argument("--project-url", help="a running server of this project")
    project.add_argument(
        "--start-project",
        metavar="ENGINE[,ENGINE]",
        help="start the launcher with each --engine in turn (torch, llamacpp)",
    )
    p.add_argument("--model-repository", type=Path, default=Path("model_repository"))
    p.add_argument("--draft-model", type=Path, default=Path("models/draft"))
    p.add_argument("--target-model", type=Path, default=Path("models/target"))
    p.add_argument(
        "--project-arg",
        dest="project_args",
        action="append",
        default=[],
        help="one more launcher argument, e.g. --project-arg=--cpu-threads=4 (repeatable)",
    )
    p.add_argument("--project-timeout", type=float, default=900.0, help="s to start serving")
    p.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON,
                   help="python of the xllamacpp venv")  # fmt: skip
    p.add_argument("--gguf", type=Path, default=ROOT / "models" / "target" / "model.gguf")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)),
                   help="llama.cpp threads, generation and batch (default: all)")  # fmt: skip
    p.add_argument("--slots", type=int, default=64, help="llama.cpp's parallel slots")
    p.add_argument("--ctx-per-slot", type=int, default=1024, help="KV tokens per slot")
    p.add_argument("--flash-attn", action="store_true", help="llama.cpp's flash attention on")
    p.add_argument("--kv-split", action="store_true",
                   help="a KV stream of --ctx-per-slot cells per slot instead of one unified pool "
                   "(llama.cpp's attention then spans a slot's own cells only)")  # fmt: skip
    p.add_argument("--llama-draft", type=Path, help="a draft GGUF: llama.cpp's speculation")
    p.add_argument("--llama-draft-max", type=int, help="its draft tokens at most")
    p.add_argument("--llama-draft-min", type=int, help="its draft tokens at least")
    p.add_argument("--llama-default-sampling", action="store_true",
                   help="keep llama.cpp's sampler chain (top-k 40, min-p 0.05, ...)")  # fmt: skip
    p.add_argument("--llama-cache-prompt", action="store_true",
                   help="let llama.cpp reuse a slot's cached prompt prefix")  # fmt: skip
    p.add_argument("--workload", type=Path, default=ROOT / "workloads" / "chat.jsonl")
    p.add_argument("--questions", type=int, default=64, help="evenly spaced, cycled")
    p.add_argument("--concurrency", default="1,16,64", help="comma list")
    p.add_argument("--requests", type=int, default=0, help="per level (0: 4 per user, >= 16)")
    p.add_argument("--warmup-requests", type=int, help="per side and level (default: 1 per user)")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--greedy", action="store_true", help="temperature 0")
    p.add_argument("--seed", type=int, default=0, help="request i: seed + i")
    p.add_argument("--request-timeout", type=float, default=600.0, help="s per request")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "llamacpp")
    args = p.parse_args(argv)
    try:
        args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    except ValueError:
        p.error(f"--concurrency: a comma list of integers, got {args.concurrency!r}")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency needs values >= 1")
    positive = ("threads", "slots", "ctx_per_slot", "questions", "rounds", "max_tokens")
    if any(getattr(args, name) < 1 for name in positive):
        p.error("--threads, --slots, --ctx-per-slot, --questions, --rounds, --max-tokens: >= 1")
    if args.requests < 0 or (args.warmup_requests or 0) < 0:
        p.error("--requests and --warmup-requests must be >= 0")
    args.engines = []
    if args.start_project is not None:
        args.engines = [e.strip() for e in args.start_project.split(",") if e.strip()]
        if not args.engines:
            p.error("--start-project needs at least one engine")
    if args.greedy:
        args.temperature = 0.0
    return args


def project_sides(args: argparse.Namespace) -> Iterator[Side]:
    """Yield each project side in turn: --project-url, or each --start-project engine started
    (and stopped before the next one starts, or when the generator is closed)."""
    if args.project_url:
        yield Side("avspec", args.project_url, MODEL, {"url": args.project_url})
        return
    from avspec.serving.host.server_process import free_port

    for engine in args.engines:
        ports = [free_port() for _ in range(3)]
        command = project_command(args, engine, ports)
        name = f"avspec-{engine}"
        print(f"[bench_llamacpp] starting {name}: {shlex.join(command)}", file=sys.stderr)
        with ProjectServer(command, ports[0], args.out / f"{name}.log", args.project_timeout) as s:
            yield Side(name, s.url, MODEL, {"command": command, "engine": engine})


def slug(name: str) -> str:
    """A side's name in file names ('llama.cpp' -> 'llamacpp')."""
    return name.replace(".", "")


def write_level_files(
    args: argparse.Namespace, info: dict[str, Any], phases: list[dict[str, Any]]
) -> None:
    """`<side>_c<N>.json` per side and level (llama.cpp's as `llamacpp-vs-<pairing>` when
    several project servers ran): the figures over rounds, each round, the context."""
    pairings = sorted({p["pairing"] for p in phases})
    for pairing in pairings:
        for side in (LLAMA, pairing):
            mine = [p for p in phases if p["pairing"] == pairing and p["side"] == side]
            stem = slug(side) + (f"-vs-{pairing}" if side == LLAMA and len(pairings) > 1 else "")
            for c, figures in combined(mine).items():
                document = {
                    "side": side,
                    "pairing": pairing,
                    "concurrency": c,
                    "figures": figures,
                    "rounds": [p["summary"] for p in mine if p["concurrency"] == c],
                    "server": info["llama"] if side == LLAMA else info["projects"][pairing],
                    "threads": args.threads if side == LLAMA else None,
                    "slots": args.slots if side == LLAMA else None,
                    "settings": info["settings"],
                    "host": info["host"],
                    "versions": info["versions"],
                }
                path = args.out / f"{stem}_c{c}.json"
                path.write_text(json.dumps(document, indent=1) + "\n")


def write_outputs(
    args: argparse.Namespace, info: dict[str, Any], phases: list[dict[str, Any]]
) -> str:
    """Every file of --out (see the module doc); returns the summary text."""
    rows = {pairing: ratio_rows(phases, pairing) for pairing in info["projects"]}
    text = summary_text(args, info, rows)
    args.out.mkdir(parents=True, exist_ok=True)
    write_level_files(args, info, phases)
    lean = [{k: v for k, v in p.items() if k != "records"} for p in phases]
    document = {"info": info, "ratios": rows, "phases": lean}
    (args.out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    records = [
        json.dumps({k: p[k] for k in ("pairing", "side", "round", "concurrency")} | record)
        for p in phases
        for record in p["records"]
    ]
    (args.out / "records.jsonl").write_text("".join(line + "\n" for line in records))
    (args.out / "summary.txt").write_text(text)
    plot(rows, args.out / "tokens_per_s.png")
    return text


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's settings, JSON-ready."""
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def run(args: argparse.Namespace) -> int:
    """The benchmark proper (see the module doc); writes --out and prints the table."""
    questions = load_questions(args.workload, args.questions)
    args.out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {
        "settings": settings(args),
        "host": host_info(),
        "versions": versions(),
        "questions": questions,
        "projects": {},
        "prompt_tokens": {},
    }
    phases: list[dict[str, Any]] = []
    started = time.monotonic()
    with ExitStack() as stack:
        config = llama_config(args, args.gguf)
        server = stack.enter_context(
            LlamaServer(args.llama_python, config, args.out / "llamacpp_server.log")
        )
        info["llama"] = {**server.info, "config": config}
        info["versions"]["xllamacpp"] = server.info.get("xllamacpp", "?")
        llama = Side(LLAMA, server.url, Path(args.gguf).name, info["llama"])
        for project in stack.enter_context(closing(project_sides(args))):
            info["projects"][project.name] = project.about
            info["prompt_tokens"][project.name] = {
                side.name: prompt_tokens(side, questions[0], args.request_timeout)
                for side in (llama, project)
            }
            phases += run_pairing(llama, project, args, questions)
    info["elapsed_s"] = round(time.monotonic() - started, 1)
    info["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    text = write_outputs(args, info, phases)
    print(text, end="")
    print(f"wrote {args.out} in {info['elapsed_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_llama_python(args.llama_python)
        if not Path(args.gguf).is_file():
            raise BenchError(f"no GGUF at {args.gguf} (--gguf)")
        return run(args)
    except BenchError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
