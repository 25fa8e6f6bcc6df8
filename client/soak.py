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
import json
import queue
import random
import shutil
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
from tqdm import tqdm

from avspec.serving.metrics import parse_metrics
from avspec.serving.server_process import ServerProcess
from avspec.serving.supervisor import find_stubs

MODEL = "speculative"
ROOT = Path(__file__).resolve().parents[1]
SHM_DIR = Path("/dev/shm")
SERVER_NAME = "tritonserver"
PROTOCOLS = ("grpc", "http", "http_stream")
PROTOCOL_WEIGHTS = (0.5, 0.25, 0.25)
STREAMING = ("grpc", "http_stream")
TEMPERATURES = (0.0, 0.7, 1.0)
LIVE_METRICS = ("av_live_sequences", "av_kv_live_sequences")
MAX_KEPT_ERRORS = 1000  # a dead server fails every request: keep the first ones, count the rest
REPORTED_ERRORS = 20
FAILURE_PAUSE_S = 1.0  # after a failure, so a dead server is not hammered in a tight loop


# ---------------------------------------------------------------------------------------------
# The request mix


@dataclass(frozen=True)
class RequestSpec:
    """One request of the mix."""

    protocol: str  # one of PROTOCOLS
    prompt: str
    max_tokens: int
    temperature: float
    num_draft_tokens: int | None  # None: the server's default
    seed: int
    cancel_after: int | None  # responses to read before cancelling; None: read to the end


@dataclass(frozen=True)
class Mix:
    """Parameters of the request mix."""

    prompts: list[str]
    min_tokens: int = 16
    max_tokens: int = 64
    cancel_fraction: float = 0.03  # of the streaming requests


def draw_request(rng: random.Random, mix: Mix) -> RequestSpec:
    """Draw one request of the mix (module docstring) with `rng`."""
    protocol = rng.choices(PROTOCOLS, PROTOCOL_WEIGHTS)[0]
    cancel = protocol in STREAMING and rng.random() < mix.cancel_fraction
    return RequestSpec(
        protocol=protocol,
        prompt=rng.choice(mix.prompts),
        max_tokens=rng.randint(mix.min_tokens, mix.max_tokens),
        temperature=rng.choice(TEMPERATURES),
        num_draft_tokens=rng.choice((0, 4, None, None)),
        seed=rng.randrange(1 << 31),
        cancel_after=rng.randint(1, 3) if cancel else None,
    )


def load_prompts(directory: Path, max_bytes: int) -> list[str]:
    """Every prompt of directory/*.jsonl whose UTF-8 length (= tokens) is at most max_bytes."""
    prompts = []
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                prompt = json.loads(line)["prompt"]
                if 0 < len(prompt.encode()) <= max_bytes:
                    prompts.append(prompt)
    return prompts


# ---------------------------------------------------------------------------------------------
# Sending requests


class RequestFailed(Exception):
    """A request ended in an error; the message is what the report keeps."""


def _payload(spec: RequestSpec, stream: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "text_input": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "random_seed": spec.seed,
        "stream": stream,
    }
    if spec.num_draft_tokens is not None:
        payload["num_draft_tokens"] = spec.num_draft_tokens
    return payload


def _http_post(url: str, payload: dict, timeout: float):
    """urlopen a JSON POST; RequestFailed on an HTTP error status or a network error."""
    request = urllib.request.Request(
        url, json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        raise RequestFailed(
            f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
        ) from None


def http_generate(base_url: str, spec: RequestSpec, timeout: float) -> str:
    """POST /generate; "ok" or RequestFailed."""
    url = f"{base_url}/v2/models/{MODEL}/generate"
    with _http_post(url, _payload(spec, False), timeout) as response:
        body = response.read()
    try:
        out = json.loads(body)
    except json.JSONDecodeError:
        raise RequestFailed(f"/generate answered non-JSON: {body[:300]!r}") from None
    if "text_output" not in out:
        raise RequestFailed(f"/generate answered without text_output: {body[:300]!r}")
    return "ok"


def http_generate_stream(base_url: str, spec: RequestSpec, timeout: float) -> str:
    """POST /generate_stream and read the events; "ok", "cancelled" or RequestFailed.

    Cancelling = closing the connection after `cancel_after` events (the `with` block does);
    Triton then cancels the request.
    """
    url = f"{base_url}/v2/models/{MODEL}/generate_stream"
    events = 0
    with _http_post(url, _payload(spec, True), timeout) as response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise RequestFailed(f"/generate_stream event: {event['error']}")
            events += 1
            if spec.cancel_after is not None and events >= spec.cancel_after:
                return "cancelled"
    if not events:
        raise RequestFailed("/generate_stream ended without an event")
    return "ok"


def _grpc_inputs(spec: RequestSpec) -> list:
    dtypes = {
        "text_input": ("BYTES", object),
        "max_tokens": ("INT32", np.int32),
        "temperature": ("FP32", np.float32),
        "random_seed": ("UINT64", np.uint64),
        "stream": ("BOOL", np.bool_),
        "num_draft_tokens": ("INT32", np.int32),
    }
    inputs = []
    for name, value in _payload(spec, True).items():
        datatype, dtype = dtypes[name]
        array = np.array([value.encode() if isinstance(value, str) else value], dtype=dtype)
        tensor = grpcclient.InferInput(name, [1], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class GrpcStream:
    """One loop's long-lived gRPC stream, reopened after a cancel or an error.

    Each stream gets its own queue, so responses of a cancelled request cannot reach the next.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: grpcclient.InferenceServerClient | None = None
        self.results: queue.Queue = queue.Queue()

    def _open(self) -> None:
        results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(self.url)
        self.client.start_stream(callback=lambda result, error: results.put((result, error)))
        self.results = results

    def close(self) -> None:
        """Stop the stream, cancelling whatever it still carries."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.stop_stream(cancel_requests=True)
            finally:
                client.close()

    def generate(self, spec: RequestSpec, request_id: str, timeout: float) -> str:
        """Send `spec` and read its responses; "ok", "cancelled" or RequestFailed."""
        if self.client is None:
            self._open()
        try:
            return self._exchange(spec, request_id, timeout)
        except BaseException:
            self.close()
            raise

    def _exchange(self, spec: RequestSpec, request_id: str, timeout: float) -> str:
        self.client.async_stream_infer(
            MODEL, _grpc_inputs(spec), request_id=request_id, enable_empty_final_response=True
        )
        responses = 0
        while True:
            try:
                result, error = self.results.get(timeout=timeout)
            except queue.Empty:
                raise RequestFailed(f"gRPC: no response for {timeout:.0f} s") from None
            if error is not None:
                raise RequestFailed(f"gRPC: {error}")
            response = result.get_response()
            responses += bool(response.outputs)
            if response.parameters["triton_final_response"].bool_param:
                return "ok"
            if spec.cancel_after is not None and responses >= spec.cancel_after:
                self.close()
                return "cancelled"


# ---------------------------------------------------------------------------------------------
# Client loops


@dataclass
class Tally:
    """Outcomes so far, thread-safe: counts by protocol and outcome, the first error texts."""

    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, protocol: str, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[(protocol, outcome)] += 1
            if outcome == "failed":
                self.failed += 1
                if len(self.errors) < MAX_KEPT_ERRORS:
                    self.errors.append(f"{protocol}: {error}")

    def total(self, outcome: str) -> int:
        with self.lock:
            return sum(n for (_, o), n in self.counts.items() if o == outcome)

    def done(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def by_protocol(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {
                p: {o: self.counts[(p, o)] for o in ("ok", "failed", "cancelled")}
                for p in PROTOCOLS
            }


@dataclass(frozen=True)
class Endpoints:
    """Where the server answers."""

    grpc_url: str
    http_url: str
    metrics_url: str | None = None


def send(
    spec: RequestSpec, endpoints: Endpoints, stream: GrpcStream, request_id: str, timeout: float
) -> str:
    """Send one request over its protocol; "ok", "cancelled" or RequestFailed."""
    if spec.protocol == "grpc":
        return stream.generate(spec, request_id, timeout)
    if spec.protocol == "http":
        return http_generate(endpoints.http_url, spec, timeout)
    return http_generate_stream(endpoints.http_url, spec, timeout)


def client_loop(
    index: int,
    endpoints: Endpoints,
    mix: Mix,
    tally: Tally,
    deadline: float,
    seed: int,
    request_timeout: float,
) -> None:
    """Send one request after another until time.monotonic() passes `deadline`."""
    rng = random.Random(seed * 100_003 + index)
    stream = GrpcStream(endpoints.grpc_url)
    n = 0
    try:
        while time.monotonic() < deadline:
            spec = draw_request(rng, mix)
            try:
                outcome = send(spec, endpoints, stream, f"soak-{index}-{n}", request_timeout)
            except RequestFailed as err:
                tally.add(spec.protocol, "failed", str(err))
                time.sleep(FAILURE_PAUSE_S)
            except Exception as err:  # noqa: BLE001 - network errors etc.: counted, loop goes on
                tally.add(spec.protocol, "failed", f"{type(err).__name__}: {err}")
                time.sleep(FAILURE_PAUSE_S)
            else:
                tally.add(spec.protocol, outcome)
            n += 1
    finally:
        stream.close()


# ---------------------------------------------------------------------------------------------
# Memory and /dev/shm


def parse_vmrss_kib(status: str) -> int | None:
    """VmRSS in KiB from the text of /proc/<pid>/status; None if absent (a zombie)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` in MiB, None if it is gone."""
    try:
        kib = parse_vmrss_kib(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return None if kib is None else kib / 1024


def shm_usage(directory: Path = SHM_DIR) -> dict[str, int]:
    """{file name: size in bytes} of the regular files directly in `directory`."""
    usage = {}
    for entry in directory.iterdir():
        try:
            if entry.is_file():
                usage[entry.name] = entry.stat().st_size
        except OSError:  # removed meanwhile
            continue
    return usage


def repository_from_cmdline(argv: list[str]) -> Path | None:
    """The --model-repository (or --model-store) of a tritonserver command line."""
    for i, arg in enumerate(argv):
        for flag in ("--model-repository", "--model-store"):
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
            if arg == flag and i + 1 < len(argv):
                return Path(argv[i + 1])
    return None


def _cmdline(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process /proc shows."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat[stat.rfind(")") + 2 :].split()[1])
    return parents


def find_tritonserver(pid: int) -> int:
    """`pid` if it is tritonserver, else its first tritonserver descendant (a launcher's child).

    ValueError if there is none.
    """
    if _comm(pid) == SERVER_NAME:
        return pid
    parents = _parents()
    frontier = [pid]
    while frontier:
        children = sorted(c for c, p in parents.items() if p in frontier)
        for child in children:
            try:
                if _comm(child) == SERVER_NAME:
                    return child
            except OSError:
                continue
        frontier = children
    raise ValueError(f"process {pid} is not tritonserver and has no tritonserver descendant")


@dataclass
class MemorySampler:
    """Samples RSS of tritonserver and its stubs and the /dev/shm total every `interval_s`.

    A stub whose pid changes between samples was restarted: that is recorded in `restarts`.
    """

    server_pid: int
    repository: Path
    tally: Tally
    interval_s: float = 5.0
    shm_dir: Path = SHM_DIR
    samples: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)  # the stubs' shm regions (file names)
    start: float = field(default_factory=time.monotonic)
    _pids: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict:
        """Take one sample now and append it."""
        pids = {SERVER_NAME: self.server_pid}
        for model, stub in sorted(find_stubs(self.server_pid, self.repository).items()):
            pids[model] = stub.pid
            self.regions.add(stub.shm_region.lstrip("/"))
        t = round(time.monotonic() - self.start, 2)
        for name, pid in pids.items():
            old = self._pids.get(name)
            if old is not None and old != pid:
                self.restarts.append({"t": t, "process": name, "old_pid": old, "new_pid": pid})
            self._pids[name] = pid
        rss = {name: rss_mib(pid) for name, pid in pids.items()}
        shm = shm_usage(self.shm_dir)
        record = {
            "t": t,
            "rss_mib": {n: round(v, 1) for n, v in rss.items() if v is not None},
            "shm_bytes": sum(shm.values()),
            "server_shm_bytes": sum(v for n, v in shm.items() if n in self.regions),
            "requests_done": self.tally.done(),
        }
        self.samples.append(record)
        return record

    def start_thread(self) -> None:
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="soak-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def series(self) -> dict[str, tuple[list[float], list[float]]]:
        """{process: (times, MiB)} over the samples that saw it."""
        out: dict[str, tuple[list[float], list[float]]] = {}
        for s in self.samples:
            for name, value in s["rss_mib"].items():
                times, values = out.setdefault(name, ([], []))
                times.append(s["t"])
                values.append(value)
        return out


# ---------------------------------------------------------------------------------------------
# Growth and plateau


def growth_after_warmup(times: list[float], values: list[float], warmup_s: float) -> float | None:
    """last / first value at t >= warmup_s, minus 1; None with fewer than two such samples."""
    post = [v for t, v in zip(times, values, strict=True) if t >= warmup_s]
    if len(post) < 2 or post[0] <= 0:
        return None
    return post[-1] / post[0] - 1


def _third_growth(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope x time span / mean level of `points`; None if under two times."""
    times = np.array([t for t, _ in points])
    values = np.array([v for _, v in points])
    if len(points) < 2 or np.ptp(times) == 0 or values.mean() <= 0:
        return None
    slope = np.polyfit(times, values, 1)[0]
    return float(slope * np.ptp(times) / values.mean())


def plateau(
    times: list[float], values: list[float], warmup_s: float, tolerance: float = 0.01
) -> dict | None:
    """Growth over the first and the last third (by time) of the samples after warm-up.

    A slope per third rather than two single samples: RSS jitters with the allocator.
    plateaued: last-third growth < max(first-third growth / 4, tolerance). None if a third has
    fewer than two samples.
    """
    post = [(t, v) for t, v in zip(times, values, strict=True) if t >= warmup_s]
    if len(post) < 2:
        return None
    t0, t1 = post[0][0], post[-1][0]
    third = (t1 - t0) / 3
    first = [(t, v) for t, v in post if t <= t0 + third]
    last = [(t, v) for t, v in post if t >= t1 - third]
    early, late = _third_growth(first), _third_growth(last)
    if early is None or late is None:
        return None
    return {
        "first_third_growth": round(early, 4),
        "last_third_growth": round(late, 4),
        "plateaued": late < max(early / 4, tolerance),
    }


def memory_report(
    series: dict[str, tuple[list[float], list[float]]], warmup_s: float
) -> dict[str, dict]:
    """Per process: first after warm-up, last, peak, growth and plateau."""
    report = {}
    for name, (times, values) in series.items():
        post = [v for t, v in zip(times, values, strict=True) if t >= warmup_s]
        report[name] = {
            "first_after_warmup_mib": post[0] if post else None,
            "last_mib": values[-1],
            "peak_mib": max(values),
            "growth": growth_after_warmup(times, values, warmup_s),
            "plateau": plateau(times, values, warmup_s),
        }
    return report


# ---------------------------------------------------------------------------------------------
# Live sequences after the load (a cancelled request that keeps its slot is a leak)


def live_sequences(metrics_url: str) -> dict[str, float]:
    """The av_live_sequences / av_kv_live_sequences samples, `name{labels}` -> value."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        samples = parse_metrics(response.read().decode())
    out = {}
    for (name, labels), value in samples.items():
        if name in LIVE_METRICS:
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels))
            out[f"{name}{{{suffix}}}" if suffix else name] = value
    return dict(sorted(out.items()))


def wait_drained(metrics_url: str, timeout_s: float) -> dict[str, float]:
    """Poll live_sequences until every value is 0 or `timeout_s` passes; the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = live_sequences(metrics_url)
        if not any(live.values()) or time.monotonic() > deadline:
            return live
        time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# The run


def run_soak(
    endpoints: Endpoints,
    mix: Mix,
    args: argparse.Namespace,
    sampler: MemorySampler | None,
    tally: Tally,
) -> dict:
    """Run the client loops for args.duration_s with a progress line; the result dict."""
    start = time.monotonic()
    deadline = start + args.duration_s
    threads = [
        threading.Thread(
            target=client_loop,
            args=(i, endpoints, mix, tally, deadline, args.seed, args.request_timeout),
            name=f"soak-loop-{i}",
            daemon=True,
        )
        for i in range(args.concurrency)
    ]
    if sampler is not None:
        sampler.start = start
        sampler.start_thread()
    for thread in threads:
        thread.start()
    _progress(deadline, args.duration_s, tally, sampler)
    # in-flight requests finish (or time out) after the deadline; one wait for all of them
    join_by = time.monotonic() + args.request_timeout + 30
    for thread in threads:
        thread.join(timeout=max(0.0, join_by - time.monotonic()))
    stuck = sum(thread.is_alive() for thread in threads)
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
    from avspec.serving.repository import build_test_repository

    work = args.out / "server"
    if work.exists():
        shutil.rmtree(work)
    # the estimator snapshot goes to the copy: a soak must not overwrite the deployed one
    overrides = {"verifier": {"snapshot_path": work / "estimator_snapshot.json"}}
    repo = build_test_repository(args.model_repository, work / "model_repository", overrides)
    ports = [_free_port() for _ in range(3)]
    server = ServerProcess(repo, *ports, log_path=work / "tritonserver.log")
    stack.enter_context(server)
    return server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_after_stop(
    before: dict[str, int], ours: set[str], timeout_s: float = 10.0, directory: Path = SHM_DIR
) -> dict:
    """/dev/shm after the server stopped: totals, and the server's regions still there.

    Waits up to `timeout_s` for the regions to go (the stubs remove theirs as they exit).
    Files that appeared meanwhile and are not the server's (another process on this machine)
    are listed but not held against the run.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = shm_usage(directory)
        left = sorted(n for n in after if n in ours)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {
        "before_bytes": sum(before.values()),
        "after_bytes": sum(after.values()),
        "returned_to_baseline": sum(after.values()) <= sum(before.values()),
        "server_regions": sorted(ours),
        "server_regions_left": left,
        "other_new_files": sorted(n for n in after if n not in before and n not in ours),
    }


# ---------------------------------------------------------------------------------------------
# Verdict and outputs


def verdict(result: dict, max_growth: float) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    reasons = []
    if result["counts"]["failed"]:
        reasons.append(f"{result['counts']['failed']} requests failed")
    if result["stuck_loops"]:
        reasons.append(f"{result['stuck_loops']} client loops still running after the deadline")
    if list(result["memory"]) == [SERVER_NAME]:
        reasons.append("no Python-backend stub found (is --model-repository the served one?)")
    for name, m in result["memory"].items():
        if m["growth"] is not None and m["growth"] >= max_growth:
            reasons.append(f"{name} grew {m['growth']:.1%} after warm-up (limit {max_growth:.0%})")
    for r in result["restarts"]:
        pids = f"pid {r['old_pid']} -> {r['new_pid']}"
        reasons.append(f"{r['process']} restarted at {r['t']:.0f} s ({pids})")
    live = {k: v for k, v in result["live_after_load"].items() if v}
    if live:
        reasons.append(f"sequences still live after the load: {live}")
    if result.get("live_error"):
        reasons.append(result["live_error"])
    shm = result.get("shm")
    if shm and shm.get("server_regions_left"):
        reasons.append(f"/dev/shm regions left behind: {shm['server_regions_left']}")
    return reasons


def summary_text(result: dict) -> str:
    """The one-screen summary."""
    c, cfg = result["counts"], result["config"]
    rate = (c["ok"] + c["cancelled"]) / max(result["elapsed_s"], 1e-9)
    protocols = ", ".join(
        f"{p} {v['ok']}/{v['failed']}/{v['cancelled']}" for p, v in result["by_protocol"].items()
    )
    lines = [
        f"soak: {cfg['concurrency']} loops, {result['elapsed_s']:.0f} s (warm-up "
        f"{cfg['warmup_s']:.0f} s), max_tokens {cfg['max_tokens']}",
        f"requests: {c['ok']} ok, {c['failed']} failed, {c['cancelled']} cancelled "
        f"({rate:.1f}/s); {protocols} (ok/failed/cancelled)",
    ]
    for error in result["errors"][:REPORTED_ERRORS]:
        lines.append(f"  error: {error[:200]}")
    if result["memory"]:
        lines.append(
            f"{'RSS MiB':<14} {'warm':>8} {'last':>8} {'peak':>8} {'growth':>8} "
            f"{'1st 3rd':>8} {'last 3rd':>8}  plateau"
        )
    for name, m in result["memory"].items():
        p = m["plateau"] or {}
        lines.append(
            f"{name:<14} {_num(m['first_after_warmup_mib']):>8} {_num(m['last_mib']):>8} "
            f"{_num(m['peak_mib']):>8} {_pct(m['growth']):>8} "
            f"{_pct(p.get('first_third_growth')):>8} {_pct(p.get('last_third_growth')):>8}  "
            f"{ {True: 'yes', False: 'NO'}.get(p.get('plateaued'), '-')}"
        )
    if not result["memory"]:
        lines.append("memory: not sampled (no --server-pid)")
    samples = result["samples"]
    if samples:
        peak = max(s["shm_bytes"] for s in samples)
        ours = [s.get("server_shm_bytes", 0) for s in samples]
        lines.append(
            f"/dev/shm during the run: {_mib(samples[0]['shm_bytes'])} at start, peak "
            f"{_mib(peak)}; the server's regions {_mib(ours[0])} at start, peak {_mib(max(ours))}"
        )
    shm = result.get("shm")
    if shm:
        lines.append(
            f"/dev/shm before {_mib(shm['before_bytes'])}, after stop {_mib(shm['after_bytes'])}"
            f" (baseline {'regained' if shm['returned_to_baseline'] else 'NOT regained'}); "
            f"server regions left: {len(shm['server_regions_left'])} of "
            f"{len(shm['server_regions'])}"
            + (
                f"; other new files: {len(shm['other_new_files'])}"
                if shm["other_new_files"]
                else ""
            )
        )
    if result["live_after_load"]:
        lines.append(f"live sequences after the load: {result['live_after_load']}")
    reasons = result["failures"]
    lines.append("PASS" if not reasons else "FAIL: " + "; ".join(reasons))
    return "\n".join(lines) + "\n"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot_memory(path: Path, samples: list[dict], warmup_s: float) -> None:
    """RSS per process and /dev/shm over time, warm-up shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_shm) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    names = list(dict.fromkeys(n for s in samples for n in s["rss_mib"]))
    for name in names:
        pts = [(s["t"], s["rss_mib"][name]) for s in samples if name in s["rss_mib"]]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=name)
    ax_shm.plot([s["t"] for s in samples], [s["shm_bytes"] / 2**20 for s in samples], "k-")
    for a in (ax, ax_shm):
        a.axvspan(0, warmup_s, color="grey", alpha=0.2, lw=0)
        a.grid(alpha=0.3)
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: resident memory (warm-up shaded)")
    ax.legend(fontsize=8)
    ax_shm.set_ylabel("/dev/shm (MiB)")
    ax_shm.set_xlabel("seconds since the load started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, result: dict) -> str:
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["samples"]:
        plot_memory(out / "memory.png", result["samples"], result["config"]["warmup_s"])
    text = summary_text(result)
    (out / "summary.txt").write_text(text)
    return text


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
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
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def main(argv: list[str] | None = None) -> int:
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
    result = _result(args, tally, run, sampler, shm)
    print(write_outputs(args.out, result), end="")
    print(f"wrote {args.out}")
    return 1 if result["failures"] else 0


def _sampler(
    server_pid: int | None, repository: Path | None, tally: Tally, args: argparse.Namespace
) -> MemorySampler | None:
    if server_pid is None:
        return None
    pid = find_tritonserver(server_pid)
    if repository is None:
        repository = repository_from_cmdline(_cmdline(pid))
        if repository is None:
            raise SystemExit(f"soak: no --model-repository in tritonserver {pid}'s command line")
    return MemorySampler(pid, repository, tally, interval_s=args.sample_s)


def _result(
    args: argparse.Namespace,
    tally: Tally,
    run: dict,
    sampler: MemorySampler | None,
    shm: dict | None,
) -> dict:
    result = {
        "config": {**_config(args), "max_tokens": list(args.token_range)},
        "counts": {o: tally.total(o) for o in ("ok", "failed", "cancelled")},
        "by_protocol": tally.by_protocol(),
        "errors": tally.errors,
        **run,
        "samples": sampler.samples if sampler else [],
        "memory": memory_report(sampler.series(), args.warmup_s) if sampler else {},
        "restarts": sampler.restarts if sampler else [],
        "shm": shm,
    }
    del result["config"]["token_range"]
    result["failures"] = verdict(result, args.max_growth)
    return result


if __name__ == "__main__":
    sys.exit(main())
