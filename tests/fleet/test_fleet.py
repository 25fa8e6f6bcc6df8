"""Loopback scale-out: three CPU servers behind nginx, 64 concurrent streams, one server killed.

Each replica is a real deployment (`python -m avspec.serving.host.launcher`: the front, tritonserver
and its stage processes, in a process group of their own) over the tiny test pair, on its own
free ports, its estimator warm-started from one shared prior (a copy of the same snapshot, as
the chart's init container makes it) and then refitting on its own traffic. nginx (Debian's
package, started here on loopback) balances HTTP (`proxy_pass`) and gRPC (`grpc_pass`, HTTP/2)
round robin over the three; its access log names the upstream(s) of every request, tagged by a
request id header. 64 client threads stream requests (48 over HTTP `generate_stream`, 16 over
tritonclient gRPC streams); once a round has completed, replica 0's whole process group gets
SIGKILL while the second round is in flight; a third round follows. Asserted:

- the requests that failed are exactly those in flight on the killed replica at the kill, and
  each failed with a clear error (an HTTP stream cut before its final event, a gRPC status);
- every request after the kill completed, on a survivor (some after nginx tried the dead
  replica first and went on: counted);
- the survivors' estimators are untouched by the kill: same processes, refit counters only
  growing, coefficients equal to their own snapshots, and apart from each other and the prior
  (each learnt on its own traffic);
- the fleet view: each replica's calibration gauges scraped from its metrics port, as
  Prometheus would per pod (recorded in bench/fleet/last_run.json).

nginx is installed by .ci/run (`apt-get install nginx-light`): missing in CI the test fails,
elsewhere it is skipped with the install command.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import tritonclient.grpc as grpcclient
from helpers import ROOT
from helpers.ci import missing_tool
from helpers.server import (
    MAX_LENGTH,
    REFIT_INTERVAL,
    REPOSITORY,
    live_processes,
    save_tiny_pair,
    stage_overrides,
    write_steep_draft_costs,
)

from avspec.av.prior import Replica, write_prior
from avspec.av.snapshot import load_snapshot
from avspec.config import EstimatorConfig
from avspec.serving.host.server_process import free_port
from avspec.serving.repository import copy_repository
from avspec.serving.stages.metrics import metric_value, parse_metrics
from avspec.tools.bench.soak.tensors import infer_inputs

pytestmark = pytest.mark.serving

REPLICAS = 3
STREAMS = 64
GRPC_STREAMS = 16
ROUNDS = 3
MAX_TOKENS = 32
K = 8
TAG = "x-fleet-request"
PRIOR_SLOPE, PRIOR_INTERCEPT = 0.6, 0.1
RECORD = ROOT / "bench" / "fleet" / "last_run.json"


def nginx_binary() -> str:
    found = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else "")
    if found:
        return found
    missing_tool("nginx not found", "apt-get install -y nginx-light (or run .ci/run)")


@dataclass
class ReplicaProcess:
    index: int
    http: int
    grpc: int
    metrics: int
    snapshot: Path
    process: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.http}"

    def scrape(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10) as r:
            return parse_metrics(r.read().decode())

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.address}/v2/health/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False


def start_replica(index: int, tmp: Path, prior: Path) -> ReplicaProcess:
    home = tmp / f"replica{index}"
    target_dir, draft_dir = save_tiny_pair(home / "models")
    snapshot = home / "runs" / "estimator_snapshot.json"
    snapshot.parent.mkdir(parents=True)
    shutil.copyfile(prior, snapshot)  # the chart's init container: copy the read-only prior
    repository = copy_repository(
        REPOSITORY,
        home / "model_repository",
        {
            "draft": stage_overrides(draft_dir),
            "target": stage_overrides(target_dir),
            "verifier": {
                "refit_interval": REFIT_INTERVAL,
                "initial_slope": 0.5,  # the tiny pair's (the repository's: the default pair's)
                "initial_intercept": -0.2,
                "snapshot_path": snapshot,
                "cost_tables": write_steep_draft_costs(home / "cost_tables.json"),
                "cost_refresh": "false",
            },
            "speculative": {"max_batch_size": 32, "max_context": MAX_LENGTH},
        },
    )
    ports = free_port(), free_port(), free_port()
    log = open(home / "launcher.log", "w")  # noqa: SIM115 - handed to the child
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "avspec.serving.host.launcher",
            "--model-repository",
            str(repository),
            "--host",
            "127.0.0.1",
            "--http-port",
            str(ports[0]),
            "--grpc-port",
            str(ports[1]),
            "--metrics-port",
            str(ports[2]),
            "--exit-timeout-secs",
            "5",
        ],  # fmt: skip
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group: the kill takes front, server, stubs
        cwd=ROOT,
    )
    return ReplicaProcess(index, *ports, snapshot, process)


def process_groups(pid: int) -> set[int]:
    """The process groups of `pid` and all its descendants (the launcher's and tritonserver's,
    which runs in a session of its own with its stage stubs)."""
    processes = live_processes()
    family, grew = {pid}, True
    while grew:
        more = {p for p, (parent, _, _) in processes.items() if parent in family} - family
        family |= more
        grew = bool(more)
    return {processes[p][1] for p in family if p in processes}


def nginx_config(tmp: Path, http_port: int, grpc_port: int, replicas) -> str:
    http_servers = "".join(
        f"    server {r.address} max_fails=1 fail_timeout=120s;\n" for r in replicas
    )
    grpc_servers = "".join(
        f"    server 127.0.0.1:{r.grpc} max_fails=1 fail_timeout=120s;\n" for r in replicas
    )
    temp = "".join(
        f"  {kind}_temp_path {tmp}/{kind};\n"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log info;
events {{ worker_connections 1024; }}
http {{
  log_format fleet '$http_{TAG.replace("-", "_")} "$upstream_addr" "$upstream_status" $status';
  access_log {tmp}/access.log fleet;
{temp}  upstream replicas_http {{
{http_servers}  }}
  upstream replicas_grpc {{
{grpc_servers}  }}
  server {{
    listen 127.0.0.1:{http_port};
    location / {{
      proxy_pass http://replicas_http;
      proxy_set_header Host $http_host;  # the client's Host (an IP here), not the upstream's
      proxy_http_version 1.1;
      proxy_buffering off;
      proxy_read_timeout 300s;
      # a generate request is safe to send again: a replica that failed to answer it (gone,
      # or its connection broke before an answer) hands it to the next one
      proxy_next_upstream error timeout non_idempotent;
    }}
  }}
  server {{
    listen 127.0.0.1:{grpc_port} http2;
    location / {{
      grpc_pass grpc://replicas_grpc;
      grpc_read_timeout 300s;
      grpc_next_upstream error timeout non_idempotent;  # as for HTTP: safe to resend
    }}
  }}
}}
"""


@dataclass
class Outcome:
    rid: str
    protocol: str
    round: int
    start: float
    end: float = 0.0
    ok: bool = False
    error: str = ""
    tokens: int = 0
    upstreams: list[str] = field(default_factory=list)


def http_stream(port: int, rid: str, prompt: str) -> tuple[int, str]:
    """One generate_stream through nginx; (text length, "") or raise with the error."""
    body = json.dumps({"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True})
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        connection.request(
            "POST",
            "/v2/models/speculative/generate_stream",
            body,
            {"Content-Type": "application/json", TAG: rid},
        )
        response = connection.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
        text = ""
        for raw in response:  # raises IncompleteRead if the chunked stream is cut
            line = raw.decode().strip()
            if line.startswith("data:"):
                event = json.loads(line[len("data:") :])
                if "error" in event:
                    raise RuntimeError(f"stream error event: {event['error']}")
                text += event.get("text_output", "")
        if not text:
            raise RuntimeError("stream ended without any text")
        return len(text), ""
    finally:
        connection.close()


def grpc_stream(port: int, rid: str, prompt: str) -> int:
    """One request over a fresh tritonclient gRPC stream through nginx; tokens, or raise."""
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    results: list = []
    done = threading.Event()

    def callback(result, error) -> None:
        results.append((result, error))
        final = result is not None and (
            result.get_response().parameters["triton_final_response"].bool_param
        )
        if error is not None or final:
            done.set()

    try:
        client.start_stream(callback=callback, headers={TAG: rid})
        values = {"text_input": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        try:
            client.async_stream_infer(
                "speculative", infer_inputs(grpcclient, values), enable_empty_final_response=True
            )
        except Exception as err:  # the stream broke before the request went out: say why
            raise RuntimeError(f"{err}; stream errors: {[str(e) for _, e in results]}") from err
        if not done.wait(120):
            raise RuntimeError("no final response within 120 s")
        errors = [str(e) for _, e in results if e is not None]
        if errors:
            raise RuntimeError(f"gRPC error: {errors[0]}")
        return sum(1 for r, _ in results if r.get_response().outputs)
    finally:
        client.stop_stream(cancel_requests=True)
        client.close()


def wait_listening(process: subprocess.Popen, ports: tuple[int, ...], deadline: float) -> None:
    """Return once a TCP connect to every port succeeds; AssertionError if `process` exits or
    the deadline passes first."""
    for port in ports:
        while True:
            assert process.poll() is None, f"nginx exited with status {process.returncode}"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, f"nginx not listening on {port} in time"
                time.sleep(0.1)


def parse_access_log(path: Path) -> dict[str, tuple[list[str], str]]:
    """request id -> (upstreams tried in order, client status) from nginx's access log."""
    found = {}
    for line in path.read_text().splitlines():
        rid, rest = line.split(" ", 1)
        upstreams = rest.split('"')[1]
        status = rest.rsplit(" ", 1)[1]
        tried = [u.strip() for u in upstreams.replace(" : ", ", ").split(",") if u.strip()]
        found[rid] = (tried, status)
    return found


def coefficients(samples: dict) -> list[float]:
    slope = metric_value(samples, "av_estimator_slope")
    return [
        slope,
        *(metric_value(samples, "av_estimator_intercept", position=str(k)) for k in range(K)),
    ]


def test_three_replicas_behind_nginx_one_killed_mid_run(tmp_path: Path) -> None:
    nginx = nginx_binary()
    began = time.monotonic()
    prior = tmp_path / "prior.json"
    write_prior(
        Replica(
            PRIOR_SLOPE,
            torch.full((K,), PRIOR_INTERCEPT, dtype=torch.float64),
            {
                name: torch.zeros(K, dtype=torch.float64)
                for name in ("A", "B", "C", "G0", "G1", "n")
            },
        ),
        prior,
    )
    replicas = [start_replica(i, tmp_path, prior) for i in range(REPLICAS)]
    http_port, grpc_port = free_port(), free_port()
    (tmp_path / "nginx.conf").write_text(nginx_config(tmp_path, http_port, grpc_port, replicas))
    proxy = None
    try:
        deadline = time.monotonic() + 300
        while not all(r.ready() for r in replicas):
            for r in replicas:
                assert r.process.poll() is None, (
                    tmp_path / f"replica{r.index}/launcher.log"
                ).read_text()[-3000:]
            assert time.monotonic() < deadline, "replicas not ready in 300 s"
            time.sleep(0.5)
        started_s = time.monotonic() - began
        proxy = subprocess.Popen(
            [nginx, "-c", str(tmp_path / "nginx.conf"), "-p", str(tmp_path)],
            stdout=subprocess.DEVNULL,
            stderr=open(tmp_path / "nginx.stderr", "w"),  # noqa: SIM115
            start_new_session=True,
        )
        # the clients start once nginx listens on both ports (a client that connected before
        # would fail at no replica, which the test would wrongly blame on the kill)
        wait_listening(proxy, (http_port, grpc_port), deadline=time.monotonic() + 30)
        outcomes: list[Outcome] = []
        lock = threading.Lock()
        round_done = threading.Barrier(STREAMS + 1)
        killed_at = [0.0]

        def client(i: int) -> None:
            protocol = "grpc" if i < GRPC_STREAMS else "http"
            for rnd in range(ROUNDS):
                rid = f"r{rnd}-c{i}"
                outcome = Outcome(rid, protocol, rnd, time.monotonic())
                prompt = f"def f{i}_{rnd}(x):\n"
                try:
                    if protocol == "grpc":
                        outcome.tokens = grpc_stream(grpc_port, rid, prompt)
                    else:
                        outcome.tokens = http_stream(http_port, rid, prompt)[0]
                    outcome.ok = True
                except Exception as err:  # noqa: BLE001 - recorded and asserted below
                    outcome.error = f"{type(err).__name__}: {err}"
                outcome.end = time.monotonic()
                with lock:
                    outcomes.append(outcome)
                if rnd == 0:
                    round_done.wait(300)  # everyone finishes round 0 before round 1 starts

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(STREAMS)]
        for t in threads:
            t.start()
        round_done.wait(300)
        # round 1 is now in flight on all three: kill replica 0 once it holds live sequences
        victim, survivors = replicas[0], replicas[1:]
        wait_live = time.monotonic() + 30
        while (
            metric_value(victim.scrape(), "av_live_sequences") < 1 and time.monotonic() < wait_live
        ):
            time.sleep(0.05)
        before = {r.index: r.scrape() for r in replicas}
        groups = process_groups(victim.process.pid)
        # the kill's start is taken before the first signal: a client thread can see its
        # connection drop, and record its failure, while the later groups are being signalled
        # (seen once in CI: two gRPC streams ended before a timestamp taken after the loop)
        signalled = time.monotonic()
        for group in groups:  # the whole pod at once: front, tritonserver, stage stubs
            os.killpg(group, signal.SIGKILL)
        # The kill's instant is when the last process of the pod is gone (its sockets closed):
        # until then nginx can still hand a new request to it, which races the kill like one in
        # flight (seen once in CI: a request 17 ms after the signal got nginx's 502).
        gone_by = time.monotonic() + 10
        while time.monotonic() < gone_by and any(
            group in groups for _, group, _ in live_processes().values()
        ):
            time.sleep(0.01)
        killed_at[:] = [signalled, time.monotonic()]
        just_after = {r.index: r.scrape() for r in survivors}
        victim.process.wait(10)
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "clients still running after 300 s"
        time.sleep(1.0)  # nginx writes the access log line when a request ends
        after = {r.index: r.scrape() for r in survivors}
        alive = {r.index: r.process.poll() is None for r in survivors}
        left = {p for p, (_, group, _) in live_processes().items() if group in groups}
        log = parse_access_log(tmp_path / "access.log")
    finally:
        if proxy is not None:
            os.killpg(proxy.pid, signal.SIGTERM)
            proxy.wait(10)
        for r in replicas:
            if r.process.poll() is None:
                os.killpg(r.process.pid, signal.SIGTERM)
        for r in replicas:
            try:
                r.process.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(r.process.pid, signal.SIGKILL)

    addresses = {f"127.0.0.1:{r.http}": r.index for r in replicas}
    addresses.update({f"127.0.0.1:{r.grpc}": r.index for r in replicas})
    for o in outcomes:
        o.upstreams = [str(addresses.get(u, u)) for u in log.get(o.rid, ([], ""))[0]]
    assert len(outcomes) == STREAMS * ROUNDS
    signalled, kill = killed_at  # SIGKILL sent; the pod's last process gone
    failed = [o for o in outcomes if not o.ok]
    # in flight on the killed replica during the kill: served there, started before the pod was
    # gone, ended after the signal
    on_victim = [o for o in outcomes if o.upstreams and o.upstreams[-1] == "0"]
    in_flight = {o.rid for o in on_victim if o.start < kill and o.end > signalled}
    finished_in_buffers = {o.rid for o in on_victim if o.ok and o.rid in in_flight}
    assert failed, "the kill hit no request in flight"
    assert not left, f"processes of the killed replica still alive: {left}"
    for o in failed:
        assert o.upstreams and o.upstreams[-1] == "0", (o, "failed but not on the killed replica")
        assert o.start < kill, (o, "started after the kill and failed")
        assert o.error.strip(), o
    assert {o.rid for o in failed} <= in_flight
    # a request in flight there either failed or had been fully sent before the kill
    late = [o for o in on_victim if o.rid in finished_in_buffers and o.end > kill + 0.5]
    assert not late, late
    after_kill = [o for o in outcomes if o.start > kill + 0.1]
    assert after_kill and all(o.ok for o in after_kill), [o for o in after_kill if not o.ok]
    assert all(o.upstreams and o.upstreams[-1] in ("1", "2") for o in after_kill)
    rerouted = [o for o in outcomes if o.ok and "0" in o.upstreams[:-1]]
    # the survivors: same processes, counters only growing, state = own snapshot, own learning
    survivor_coefficients = []
    for r in survivors:
        assert alive[r.index], f"survivor {r.index} died"
        refits_before = metric_value(before[r.index], "av_estimator_refits_total")
        refits_after = metric_value(after[r.index], "av_estimator_refits_total")
        assert refits_after >= refits_before and refits_after > 0, (r.index, refits_after)
        # untouched by the kill: with no refit in between, the coefficients are the same
        if metric_value(just_after[r.index], "av_estimator_refits_total") == refits_before:
            assert coefficients(just_after[r.index]) == coefficients(before[r.index])
        saved = load_snapshot(r.snapshot, EstimatorConfig(num_positions=K))
        live = coefficients(after[r.index])
        # every refit keeps the coefficients within the snapshot bounds (EstimatorConfig.max_step
        # and the clamps of AcceptanceEstimator.refit), so the file always holds the live state
        assert live == pytest.approx(
            [float(saved.slope), *saved.intercepts.tolist()], abs=1e-4
        ), "a survivor's gauges differ from its own snapshot"
        assert live != pytest.approx([PRIOR_SLOPE] + [PRIOR_INTERCEPT] * K, abs=1e-6)
        survivor_coefficients.append(live)
    assert survivor_coefficients[0] != pytest.approx(survivor_coefficients[1], abs=1e-6)
    fleet = {
        str(r.index): {
            name: metric_value((after if r.index in after else before)[r.index], name)
            for name in (
                "av_calibration_mean_predicted",
                "av_calibration_observed_rate",
                "av_calibration_ece",
                "av_estimator_slope",
                "av_estimator_refits_total",
                "av_accepted_tokens_total",
                "av_verified_tokens_total",
            )
        }
        for r in replicas
    }
    for index in ("1", "2"):
        assert 0 <= fleet[index]["av_calibration_observed_rate"] <= 1, fleet[index]
    record = {
        "replicas": REPLICAS,
        "streams": STREAMS,
        "grpc_streams": GRPC_STREAMS,
        "rounds": ROUNDS,
        "requests": len(outcomes),
        "failed": len(failed),
        "failed_by_protocol": {
            p: sum(1 for o in failed if o.protocol == p) for p in ("http", "grpc")
        },
        "failed_error_samples": sorted({f"{o.protocol}: {o.error[:160]}" for o in failed})[:6],
        "in_flight_on_killed": len(in_flight),
        "in_flight_but_already_sent": len(finished_in_buffers),
        "after_kill_ok_on_survivors": len(after_kill),
        "rerouted_after_trying_killed": len(rerouted),
        "served_by": {
            str(i): sum(1 for o in outcomes if o.ok and o.upstreams[-1:] == [str(i)])
            for i in range(REPLICAS)
        },
        "fleet_calibration": fleet,
        "startup_s": round(started_s, 1),
        "total_s": round(time.monotonic() - began, 1),
    }
    print(json.dumps(record, indent=1))
    RECORD.parent.mkdir(parents=True, exist_ok=True)
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
