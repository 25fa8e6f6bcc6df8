"""The launcher against a real server: a broken model, the CLI's ready line and signals, and
the GPU container's options (two repositories, a config name, a load list)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.server import live_processes, wait_for_line

from avspec.serving.host import launcher
from avspec.serving.host.server_process import ServerProcess, free_port
from avspec.serving.host.settings import (
    ModelSettings,
    NetworkSettings,
    ServeSettings,
    TritonSettings,
)
from avspec.serving.host.supervisor import find_stubs


@pytest.mark.serving
def test_main_reports_a_server_that_dies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model whose initialize raises: the server exits and main returns 1 with a message."""
    _echo_repository(tmp_path, "broken", BROKEN_MODEL)
    ports = [str(free_port()) for _ in range(3)]
    code = launcher.main(
        ["--model-repository", str(tmp_path), "--http-port", ports[0], "--grpc-port", ports[1],
         "--metrics-port", ports[2], "--ready-timeout-secs", "60"]
    )  # fmt: skip
    assert code == 1
    assert "exited with code" in capsys.readouterr().err


@pytest.mark.serving
def test_cli_prints_ready_line_and_stops_on_sigterm(tmp_path: Path) -> None:
    _echo_repository(tmp_path)
    ports = [str(free_port()) for _ in range(3)]
    process = subprocess.Popen(
        [sys.executable, "-m", "avspec.serving.host.launcher", "--model-repository", str(tmp_path),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        if line.startswith("avspec: dropping root"):  # started as root: the sandbox re-exec
            line = process.stdout.readline()
        assert line.startswith(
            f"avspec: serving 1 models on 0.0.0.0, HTTP :{ports[0]} gRPC :{ports[1]} "
            f"metrics :{ports[2]} (public: inference on 'speculative', health, metrics; "
            "admin API closed)"
        ), line
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "stopped on SIGTERM" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()


ECHO_MODEL = "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
BROKEN_MODEL = (
    "class TritonPythonModel:\n"
    "    def initialize(self, args):\n"
    "        raise RuntimeError('broken on purpose')\n"
)


def _echo_repository(root: Path, name: str = "speculative", model_py: str = ECHO_MODEL) -> Path:
    """A repository with a Python model `name` that loads instantly (one stub process), or runs
    `model_py` instead.

    By default `speculative`, the public model the launcher's front serves by default.
    """
    model = root / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(model_py)
    return root


@pytest.mark.serving
def test_two_repositories_a_config_name_and_a_load_list(tmp_path: Path) -> None:
    """The GPU container's options on the bundled server: only the listed models load, from
    both repositories, under the config name; the supervisor watches the stubs of both."""
    _echo_repository(tmp_path / "first")
    second = _echo_repository(tmp_path / "second", "stage")
    _echo_repository(second, "unlisted")
    config = (second / "stage" / "config.pbtxt").read_text()
    (second / "stage" / "configs").mkdir()
    (second / "stage" / "configs" / "gpu.pbtxt").write_text(
        config + 'parameters { key: "variant" value: { string_value: "gpu" } }\n'
    )
    server = ServerProcess(
        ServeSettings(
            ModelSettings(
                (tmp_path / "first", second),
                load_models=["stage", "speculative"],
                model_config_name="gpu",
            ),
            NetworkSettings(free_port(), free_port(), free_port()),
            TritonSettings(exit_timeout_s=5, log_path=tmp_path / "triton.log"),
        )
    )
    with server:
        assert server.supervisor.models == ["speculative", "stage"]
        assert not server.triton_api.ok("/v2/models/unlisted/ready")
        status, body = server.triton_api.request("GET", "/v2/models/stage/config")
        assert status == 200
        parameters = json.loads(body)["parameters"]  # read from configs/gpu.pbtxt
        assert parameters["variant"]["string_value"] == "gpu"
        stubs = find_stubs(server.process.pid, tmp_path)
        os.kill(stubs["stage"].pid, signal.SIGKILL)  # a stage of the second repository dies
        deadline = time.monotonic() + 60
        while server.supervisor.restarts["stage"] == 0 or not server.supervisor.ready():
            assert time.monotonic() < deadline, "the stage was not reloaded"
            time.sleep(0.2)
        assert find_stubs(server.process.pid, second)["stage"].pid != stubs["stage"].pid


@pytest.mark.serving
def test_cli_two_quick_sigterms_stop_everything(tmp_path: Path) -> None:
    """`make` forwards SIGTERM twice: the second must not interrupt the stop half-way.

    Before the fix it raised inside stop(): a traceback, exit status 1, and tritonserver and its
    stub left running and serving.
    """
    repository = _echo_repository(tmp_path / "repository")
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    ports = [str(free_port()) for _ in range(3)]
    with out.open("w") as stdout, err.open("w") as stderr:
        launcher_process = subprocess.Popen(
            [sys.executable, "-m", "avspec.serving.host.launcher", "--model-repository",
             str(repository), "--http-port", ports[0], "--grpc-port", ports[1],
             "--metrics-port", ports[2]],
            stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip
    pgid = None
    try:
        wait_for_line(out, "avspec: serving", launcher_process, timeout_s=120)
        processes = live_processes()
        [pgid] = [pid for pid, (ppid, *_) in processes.items() if ppid == launcher_process.pid]
        group = {pid: cmd for pid, (_, g, cmd) in processes.items() if g == pgid}
        assert any("triton_python_backend_stub" in cmd for cmd in group.values()), group
        launcher_process.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        launcher_process.send_signal(signal.SIGTERM)
        assert launcher_process.wait(timeout=60) == 0, err.read_text()[-3000:]
        assert "Traceback" not in err.read_text()
        assert "stopped on SIGTERM" in out.read_text()
        left = {
            pid: cmd
            for pid, (_, g, cmd) in live_processes().items()
            if g == pgid or str(repository) in cmd
        }
        assert left == {}
    finally:
        if launcher_process.poll() is None:
            launcher_process.kill()
            launcher_process.wait()
        if pgid is not None:  # never leave a server behind, whatever failed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)


@pytest.mark.serving
def test_tritonserver_dies_with_a_killed_launcher(tmp_path: Path) -> None:
    """SIGKILL of the launcher (the OOM killer, `kill -9`): the kernel takes tritonserver and its
    stubs down with it (parent-death signal), instead of leaving them serving on held sockets."""
    repository = _echo_repository(tmp_path / "repository")
    out = tmp_path / "stdout.txt"
    ports = [str(free_port()) for _ in range(3)]
    with out.open("w") as stdout:
        launcher_process = subprocess.Popen(
            [sys.executable, "-m", "avspec.serving.host.launcher", "--model-repository",
             str(repository), "--http-port", ports[0], "--grpc-port", ports[1],
             "--metrics-port", ports[2]],
            stdout=stdout, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
    try:
        wait_for_line(out, "avspec: serving", launcher_process, timeout_s=120)
        processes = live_processes()
        [pgid] = [pid for pid, (ppid, *_) in processes.items() if ppid == launcher_process.pid]
        assert any(g == pgid and "stub" in cmd for _, (_, g, cmd) in processes.items())
        launcher_process.kill()
        launcher_process.wait(timeout=30)
        deadline = time.monotonic() + 30
        while left := [pid for pid, (_, g, _) in live_processes().items() if g == pgid]:
            assert time.monotonic() < deadline, f"still running after the launcher died: {left}"
            time.sleep(0.2)
    finally:
        if launcher_process.poll() is None:
            launcher_process.kill()
