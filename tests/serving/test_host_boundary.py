"""What another local user of the host can reach (issue: no way to root).

The review found that any local user read the admin key off tritonserver's command line, loaded a
model with a `file:1/model.py` override through Triton's loopback port, and that model ran as
root; the Python backend's shared memory was readable by everyone; Triton's metrics port served
any path. The attacker here is a real other user (`nobody`, through `su`, with shell tools only:
this host's Python lives where `nobody` cannot enter), against the session's server started as
root, as `make serve` is in CI.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from helpers.server import ADMIN_KEY, live_processes

from avspec.serving.host.sandbox import DEFAULT_SERVER_USER
from avspec.serving.host.server_process import ServerProcess

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to start as root, and su)")
EVIL_LOAD = json.dumps(
    {
        "parameters": {
            "config": json.dumps({"name": "evil", "backend": "python"}),
            "file:1/model.py": "aW1wb3J0IG9zCg==",
        }
    }
)


def as_nobody(command: str) -> subprocess.CompletedProcess:
    """Run a shell command as user nobody; its output and exit status."""
    return subprocess.run(
        ["su", "-s", "/bin/sh", "nobody", "-c", command],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def server_processes(server: ServerProcess) -> dict[int, str]:
    """pid -> command line of tritonserver and every process in its group (the stubs)."""
    group = os.getpgid(server.process.pid)
    return {pid: cmd for pid, (_, pgid, cmd) in live_processes().items() if pgid == group}


def uid_of(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1])


@as_root
def test_no_stage_runs_as_root(server: ServerProcess) -> None:
    """Started as root, tritonserver and every stub run as the dedicated user."""
    processes = server_processes(server)
    assert any("triton_python_backend_stub" in cmd for cmd in processes.values()), processes
    expected = int(DEFAULT_SERVER_USER.partition(":")[0])
    assert {pid: uid_of(pid) for pid in processes} == dict.fromkeys(processes, expected)


@as_root
def test_no_secret_on_any_command_line_or_environment(server: ServerProcess) -> None:
    """Every local user reads /proc/<pid>/cmdline: the admin key is on none of the server's,
    and no key of any kind is handed to tritonserver."""
    for pid in server_processes(server):
        shown = as_nobody(f"cat /proc/{pid}/cmdline; cat /proc/{pid}/environ")
        assert ADMIN_KEY not in shown.stdout
        assert "restricted-api" not in shown.stdout and "avspec-front-key" not in shown.stdout
    assert ADMIN_KEY not in Path(f"/proc/{os.getpid()}/cmdline").read_text()


@as_root
def test_a_local_user_cannot_reach_triton(server: ServerProcess) -> None:
    """Triton listens on Unix sockets in a directory only its user may enter: `nobody` cannot
    load a model with a file override, drive an internal stage, or even list the directory."""
    attempts = {
        "load": f"curl -sS --unix-socket {server.http_socket} -X POST "
        f"http://x/v2/repository/models/evil/load -d '{EVIL_LOAD}'",
        "infer": f"curl -sS --unix-socket {server.http_socket} -X POST "
        "http://x/v2/models/draft/infer -d '{\"inputs\": []}'",
        "list": f"ls {server.http_socket.parent}",
    }
    for name, command in attempts.items():
        result = as_nobody(command)
        assert result.returncode != 0, (name, result.stdout)
        assert "denied" in result.stderr.lower() or "couldn't connect" in result.stderr.lower()
    # the operator (root) still reaches it: the sockets are there and serve
    assert server.triton_api.ok("/v2/health/ready")


@as_root
def test_shared_memory_is_private(server: ServerProcess) -> None:
    """The Python backend's regions (mode 0644, request tensors pass through them) live in the
    server's own /dev/shm: none in the host's, and `nobody` cannot look into the server's."""
    own = Path(f"/proc/{server.process.pid}/root/dev/shm")
    regions = [p for p in own.iterdir() if not p.name.startswith(".")]
    assert regions, "the server's private /dev/shm holds no region"
    host = {p.name for p in Path("/dev/shm").iterdir()}
    assert not host & {p.name for p in regions}
    assert oct(own.stat().st_mode & 0o777) == "0o700"
    for command in (f"ls {own}", f"wc -c {regions[0]}"):
        result = as_nobody(command)
        assert result.returncode != 0 and "denied" in result.stderr.lower(), command


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def test_metrics_port_serves_only_metrics(server: ServerProcess) -> None:
    """The public metrics port is the front's: /metrics, and 404 elsewhere (Triton's own
    answered 200 with an empty body on any path, `/v2/health/ready` included)."""
    status, body = _get(server.metrics_url)
    assert status == 200 and b"av_estimator_slope" in body and b"nv_inference" in body
    base = server.metrics_url.removesuffix("/metrics")
    for path in ("/v2/health/ready", "/", "/metrics/x"):
        assert _get(base + path)[0] == 404, path
    # Triton's own metrics listen on loopback only, not on the public address
    assert "--metrics-address=127.0.0.1" in " ".join(server_processes(server).values())
