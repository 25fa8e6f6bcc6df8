#!/usr/bin/env python3
"""What the HTTP front costs: requests per second and latency through it against Triton directly.

Side by side in one run, rounds alternating, each front in a process of its own:
  - `direct`: the upstream itself (a fake Triton HTTP, an aiohttp server in its own process,
    answering at once or after `delay:MS` given as the prompt; or, with --real, tritonserver's
    own Unix socket);
  - `after`: this checkout's front (avspec.serving.front.Front);
  - `before`: another checkout's front (--before DIR: its `backend/`, e.g. a `git worktree` of
    the previous commit).
Measures (1) small requests over one keep-alive connection, one at a time (http.client, which
opens a new connection whenever the server closed the last one): GET /v2/health/live and a
4-token POST generate, requests per second; (2) concurrency C (default 16, one connection
each, aiohttp) of generate calls the upstream answers after --delay-ms: mean latency, and the
ratio to `direct`. The CPU each serving process spent per request is reported next to (1): on
a machine other jobs share it is steadier than requests per second. With --real, against a real
server on the shipped pair: health requests per second on one keep-alive connection (Triton's
socket; each front in its own process before it), and 8-token greedy generate latency at
concurrency C through the server's front vs tritonserver's Unix socket. Prints a table and
writes JSON; asserts nothing.

    .venv/bin/python client/bench_front.py --before /tmp/front-before --rounds 3 \
        --out bench/front.json [--real]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMALL_BODY = {"text_input": "hi", "max_tokens": 4}


def _serve_fake(path: str) -> None:
    """A fake Triton HTTP on Unix socket `path` (as tritonserver's is): health 200 at once,
    generate answers after `delay:MS` of its prompt."""
    from aiohttp import web

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    async def generate(request: web.Request) -> web.Response:
        prompt = (await request.json())["text_input"]
        if prompt.startswith("delay:"):
            await asyncio.sleep(int(prompt[6:]) / 1000)
        return web.json_response({"text_output": "abcd", "output_ids": [1, 2, 3, 4]})

    app = web.Application()
    app.router.add_get("/v2/health/live", health)
    app.router.add_post("/v2/models/speculative/generate", generate)
    web.run_app(app, path=path, access_log=None, print=None)


def _serve_front(upstream: str) -> None:
    """A front (whichever avspec is first on the path) before `upstream`; prints its port."""
    from avspec.serving.front import Front, FrontConfig

    config = FrontConfig("127.0.0.1", 0, 0, upstream_http=upstream, upstream_grpc="127.0.0.1:1")
    with Front(config) as front:
        print(front.http_port, flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (to call the fake upstream directly)."""

    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def _spawn(args: list[str], pythonpath: str | None = None) -> tuple[subprocess.Popen, int]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    process = subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env
    )
    return process, int(process.stdout.readline())


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process `pid` has used (all its threads)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def sequential_rps(port: int | str, method: str, path: str, seconds: float) -> tuple[float, int]:
    """Requests per second of one client on one keep-alive connection (reopened if closed),
    and how many requests that was; `port` a TCP port, or the path of a Unix socket."""
    if isinstance(port, str):
        connection: http.client.HTTPConnection = _UnixConnection(port)
    else:
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps(SMALL_BODY).encode() if method == "POST" else None
    count, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds:
        connection.request(method, path, body=body)
        response = connection.getresponse()
        response.read()
        assert response.status == 200, response.status
        if response.will_close:
            connection.close()
        count += 1
    connection.close()
    return count / elapsed, count


async def _concurrent(url: str, body: dict, concurrency: int, each: int, unix: str | None) -> float:
    """Mean seconds per generate call, `concurrency` clients with a connection each."""
    import aiohttp

    async def client() -> list[float]:
        connector = aiohttp.UnixConnector(unix) if unix else aiohttp.TCPConnector()
        took = []
        async with aiohttp.ClientSession(connector=connector) as session:
            for _ in range(each):
                started = time.perf_counter()
                async with session.post(url, json=body) as response:
                    await response.read()
                    assert response.status == 200, response.status
                took.append(time.perf_counter() - started)
        return took

    results = await asyncio.gather(*(client() for _ in range(concurrency)))
    return statistics.mean(t for took in results for t in took[1:])  # first: connection setup


def concurrent_latency(url: str, body: dict, concurrency: int, each: int, unix=None) -> float:
    return asyncio.run(_concurrent(url, body, concurrency, each, unix))


def bench_fake(args: argparse.Namespace, tmp: Path) -> dict:
    socket_path = str(tmp / "fake-triton.sock")
    fake = subprocess.Popen(
        [sys.executable, __file__, "--serve-fake", socket_path], stdin=subprocess.PIPE
    )
    while not os.path.exists(socket_path):
        time.sleep(0.05)
    upstream = f"unix:{socket_path}"
    targets: dict[str, tuple[subprocess.Popen | None, int | str]] = {"direct": (None, socket_path)}
    processes = [fake]
    try:
        if args.before:
            before = _spawn(["--serve-front", upstream], str(Path(args.before) / "backend"))
            processes.append(before[0])
            targets["before"] = before
        after = _spawn(["--serve-front", upstream], str(ROOT / "backend"))
        processes.append(after[0])
        targets["after"] = after
        rows: dict[str, dict[str, list[float]]] = {name: {} for name in targets}
        delayed = {"text_input": f"delay:{args.delay_ms}", "max_tokens": 4}
        for _ in range(args.rounds):
            for name, (_, port) in targets.items():
                row = rows[name]
                pid = (targets[name][0] or fake).pid
                for label, method, path in (
                    ("health", "GET", "/v2/health/live"),
                    ("generate", "POST", "/v2/models/speculative/generate"),
                ):
                    cpu = cpu_seconds(pid)
                    rps, count = sequential_rps(port, method, path, args.seconds)
                    row.setdefault(f"{label}_rps", []).append(rps)
                    # CPU the serving process spent per request: the front's own cost,
                    # steadier than requests per second on a machine other jobs share
                    cpu_us = (cpu_seconds(pid) - cpu) / count * 1e6
                    row.setdefault(f"{label}_cpu_us", []).append(cpu_us)
                unix = port if isinstance(port, str) else None
                host = "localhost" if unix else f"127.0.0.1:{port}"
                url = f"http://{host}/v2/models/speculative/generate"
                latency = concurrent_latency(url, delayed, args.concurrency, args.each, unix)
                row.setdefault(f"c{args.concurrency}_ms", []).append(latency * 1000)
        return rows
    finally:
        for process in processes:
            process.stdin.close()
            process.terminate()
            process.wait()


def bench_real(args: argparse.Namespace) -> dict:
    """Against a real server on the shipped pair: health requests per second on one keep-alive
    connection (Triton's socket, and each front in its own process before it), and generate
    latency at concurrency C through the server's front vs Triton's socket."""
    import tempfile

    from avspec.serving.host.server_process import ServerProcess, free_port
    from avspec.serving.host.settings import ServeSettings

    body = {"text_input": "def main(", "max_tokens": 8, "temperature": 0.0}
    rows: dict[str, dict[str, list[float]]] = {"direct": {}, "after": {}}
    with (
        tempfile.TemporaryDirectory() as tmp,
        ServerProcess(
            ServeSettings.for_repository(
                ROOT / "model_repository", [free_port() for _ in range(3)], Path(tmp) / "triton.log"
            )
        ) as server,
    ):  # fmt: skip
        upstream = f"unix:{server.http_socket}"
        fronts = {"direct": (None, str(server.http_socket))}
        if args.before:
            fronts["before"] = _spawn(
                ["--serve-front", upstream], str(Path(args.before) / "backend")
            )
            rows["before"] = {}
        fronts["after"] = _spawn(["--serve-front", upstream], str(ROOT / "backend"))
        path = "/v2/models/speculative/generate"
        try:
            for _ in range(args.rounds):
                for name, (_, port) in fronts.items():
                    rps, _ = sequential_rps(port, "GET", "/v2/health/live", args.seconds)
                    rows[name].setdefault("health_rps", []).append(rps)
                for name, url, unix in (
                    ("direct", f"http://localhost{path}", str(server.http_socket)),
                    ("after", server.http_url + path, None),
                ):
                    latency = concurrent_latency(url, body, args.concurrency, args.each, unix)
                    rows[name].setdefault(f"c{args.concurrency}_ms", []).append(latency * 1000)
        finally:
            for process, _ in fronts.values():
                if process is not None:
                    process.stdin.close()
                    process.terminate()
                    process.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", help="checkout of the front to compare with (its root)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=3.0, help="per sequential measure")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--each", type=int, default=20, help="calls per concurrent client")
    parser.add_argument("--delay-ms", type=int, default=50, help="the fake's generation time")
    parser.add_argument("--real", action="store_true", help="also against a real server")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--serve-fake", metavar="SOCKET", help=argparse.SUPPRESS)
    parser.add_argument("--serve-front", metavar="UPSTREAM", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_fake:
        _serve_fake(args.serve_fake)
        return
    if args.serve_front:
        _serve_front(args.serve_front)
        return
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        results = {"fake": bench_fake(args, Path(tmp))}
    if args.real:
        results["real"] = bench_real(args)
    for kind, rows in results.items():
        print(f"{kind} upstream (median of {args.rounds} rounds)")
        for name, row in rows.items():
            cells = ", ".join(f"{k} {statistics.median(v):.1f}" for k, v in row.items())
            print(f"  {name:7s} {cells}")
        direct = rows["direct"]
        for name in [n for n in rows if n != "direct"]:
            for key, values in [(k, v) for k, v in rows[name].items() if k in direct]:
                ratio = statistics.median(values) / statistics.median(direct[key])
                print(f"  {name}/direct {key}: {ratio:.2f}")
        if "before" in rows:
            for key in [k for k in rows["before"] if k in rows["after"]]:
                ratio = statistics.median(rows["after"][key]) / statistics.median(
                    rows["before"][key]
                )
                print(f"  after/before {key}: {ratio:.2f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
