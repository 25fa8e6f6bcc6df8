"""The launcher's pieces, and its failure path against a real (broken) server."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import free_port

from avspec.serving import launcher
from avspec.serving.served_models import model_config_file, python_models, repository_models
from avspec.serving.server_process import ServerError, ServerProcess
from avspec.serving.supervisor import find_stubs
from avspec.serving.triton_env import (
    BACKEND_SOURCE_DIR,
    TritonInstall,
    prepare_backend_directory,
    server_environment,
    tritonserver_binary,
)

ROOT = Path(__file__).resolve().parents[2]


def test_backend_directory_holds_python_backend(tmp_path: Path) -> None:
    python = prepare_backend_directory(tmp_path) / "python"
    for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
        assert (python / name).is_file()
    assert os.access(python / "triton_python_backend_stub", os.X_OK)


def test_server_environment() -> None:
    env = server_environment({"PATH": "/usr/bin"}, cpu_threads=1)
    assert env["OMP_NUM_THREADS"] == "1"
    assert "nvidia_pytriton.libs" in env["LD_LIBRARY_PATH"]
    assert env["PATH"].endswith(":/usr/bin")
    assert str(BACKEND_SOURCE_DIR) in env["PYTHONPATH"]
    assert "OMP_NUM_THREADS" not in server_environment({}, cpu_threads=None)


def test_installed_server_keeps_its_environment_but_the_thread_cap() -> None:
    """Another tritonserver (the NGC image's) has its own python3 and PYTHONPATH: kept as is."""
    base = {"PATH": "/usr/bin", "PYTHONPATH": "/opt/avspec/backend", "LD_LIBRARY_PATH": "/x"}
    assert server_environment(base, cpu_threads=1, bundled=False) == base | {"OMP_NUM_THREADS": "1"}
    assert server_environment(base, cpu_threads=None, bundled=False) == base


def _fake_tritonserver(directory: Path) -> Path:
    binary = directory / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    return binary


def test_triton_install_tells_the_wheel_server_from_an_installed_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wheel = TritonInstall.find()
    assert wheel.binary == tritonserver_binary() and wheel.bundled and wheel.assembles_backends
    assert TritonInstall.find(tritonserver_binary()).bundled
    binary = _fake_tritonserver(tmp_path)
    monkeypatch.setenv("PATH", f"{binary.parent}:/usr/bin:/bin")
    installed = TritonInstall.find("tritonserver")  # a bare name: looked up on PATH
    assert installed.binary == binary.resolve() and not installed.bundled
    assert not installed.assembles_backends  # tritonserver's own default backend directory
    assert TritonInstall.find(binary, tmp_path).backend_directory == tmp_path.resolve()
    with pytest.raises(FileNotFoundError, match="not a directory"):
        TritonInstall.find(binary, tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="no 'no-such-server' on PATH"):
        TritonInstall.find("no-such-server")


def test_missing_or_empty_repository(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="not a directory"):
        ServerProcess(tmp_path / "absent")
    with pytest.raises(ServerError, match="no model"):
        ServerProcess(tmp_path)
    _model(tmp_path / "repository", "m", 'backend: "python"')
    with pytest.raises(ServerError, match="not an executable"):
        ServerProcess(tmp_path / "repository", tritonserver=tmp_path / "absent" / "tritonserver")


def _model(repository: Path, name: str, config: str, gpu_config: str | None = None) -> None:
    (repository / name / "configs").mkdir(parents=True)
    (repository / name / "config.pbtxt").write_text(config)
    if gpu_config is not None:
        (repository / name / "configs" / "gpu.pbtxt").write_text(gpu_config)


def test_models_are_found_across_repositories_under_a_config_name(tmp_path: Path) -> None:
    """As Triton reads them: configs/<name>.pbtxt where it exists; a name in one repository."""
    first, second = tmp_path / "first", tmp_path / "second"
    _model(first, "entry", 'backend: "python"')
    _model(first, "cpu_only", 'backend: "python"', gpu_config='backend: "onnxruntime"')
    _model(first, "pipeline", 'platform: "ensemble"')
    _model(second, "engine", 'backend: "tensorrtllm"')
    _model(second, "adapter", 'backend: "python"')
    assert model_config_file(first / "cpu_only", "gpu") == first / "cpu_only/configs/gpu.pbtxt"
    assert model_config_file(first / "entry", "gpu") == first / "entry/config.pbtxt"
    assert python_models(first) == ["cpu_only", "entry"]
    assert python_models(first, "gpu") == ["entry"]
    server = ServerProcess(first, extra_repositories=[second], model_config_name="gpu")
    assert server.models == ["adapter", "cpu_only", "engine", "entry", "pipeline"]
    assert server.supervised_models() == ["adapter", "entry"]
    assert server.model_homes["adapter"] == second.resolve()
    _model(second, "entry", 'backend: "python"')
    with pytest.raises(ServerError, match="'entry' is in several of the repositories"):
        ServerProcess(first, extra_repositories=[second])
    with pytest.raises(ServerError, match="'absent' is in none of the repositories"):
        ServerProcess(first, load_models=["entry", "absent"])


def test_gpu_deployment_supervises_its_python_stages(tmp_path: Path) -> None:
    """The container's repositories and load list: every Python-backend stage is watched, in
    both repositories; the engine (C++ backend) and the ensemble have no stub to watch."""
    loads = [
        "tensorrt_llm",
        "trtllm_target",
        "draft",
        "verifier",
        "speculative_step",
        "speculative",
    ]
    server = ServerProcess(
        ROOT / "model_repository",
        extra_repositories=[ROOT / "model_repository_gpu"],  # the templates: same backends
        model_config_name="gpu",
        load_models=loads,
        tritonserver=_fake_tritonserver(tmp_path),
    )
    assert server.models == loads  # readiness waits for each
    assert server.supervised_models() == ["trtllm_target", "draft", "verifier", "speculative"]
    command = server.command(None)
    assert "--load-model=*" not in command and "--backend-directory" not in " ".join(command)
    assert [a for a in command if a.startswith("--load-model=")] == [
        f"--load-model={m}" for m in loads
    ]


def test_command_uses_explicit_model_control(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    server = ServerProcess(tmp_path, 1, 2, 3)
    server.internal_http_port, server.internal_grpc_port = 11, 12
    assert repository_models(tmp_path) == ["m"]
    command = server.command(tmp_path / "backends")
    assert command[0] == str(tritonserver_binary())
    assert f"--model-repository={tmp_path.resolve()}" in command
    assert f"--backend-directory={tmp_path / 'backends'}" in command
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert not any(a.startswith("--model-config-name") for a in command)
    # Triton's own ports on loopback only; the public ports are the front's
    assert "--http-address=127.0.0.1" in command and "--http-port=11" in command
    assert "--grpc-address=127.0.0.1" in command and "--grpc-port=12" in command
    assert "--metrics-port=3" in command
    assert server.http_url.endswith(":1") and server.metrics_url.endswith(":3/metrics")


def test_command_restricts_inference_to_the_front_and_admin_to_the_key(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    server = ServerProcess(tmp_path, admin_key="operator-key-0123456789")
    command = server.command(tmp_path / "backends")
    front = f"inference:avspec-front-key={server.keys.front_key}"
    admin = "model-repository,model-config,shared-memory,statistics,trace,logging"
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        assert f"{flag}={front}" in command
        assert f"{flag}={admin}:avspec-admin-key=operator-key-0123456789" in command
    assert ServerProcess(tmp_path).keys.admin_key != ServerProcess(tmp_path).keys.admin_key


@pytest.mark.serving
def test_main_reports_a_server_that_dies(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A model whose initialize raises: the server exits and main returns 1 with a message."""
    model = tmp_path / "broken"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "y" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n"
        "    def initialize(self, args):\n"
        "        raise RuntimeError('broken on purpose')\n"
    )
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
        [sys.executable, "-m", "avspec.serving.launcher", "--model-repository", str(tmp_path),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
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


def _echo_repository(root: Path, name: str = "speculative") -> Path:
    """A repository with a Python model `name` that loads instantly (one stub process).

    By default `speculative`, the public model the launcher's front serves by default.
    """
    model = root / name
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n    def execute(self, requests):\n        return []\n"
    )
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
        tmp_path / "first",
        free_port(),
        free_port(),
        free_port(),
        exit_timeout_s=5,
        log_path=tmp_path / "triton.log",
        extra_repositories=[second],
        model_config_name="gpu",
        load_models=["stage", "speculative"],
    )
    with server:
        assert server.supervisor.models == ["speculative", "stage"]
        assert not server._http_ok("/v2/models/unlisted/ready")
        request = urllib.request.Request(
            f"{server.internal_http_url}/v2/models/stage/config",
            headers={"avspec-admin-key": server.keys.admin_key},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            parameters = json.load(response)["parameters"]  # read from configs/gpu.pbtxt
        assert parameters["variant"]["string_value"] == "gpu"
        stubs = find_stubs(server.process.pid, tmp_path)
        os.kill(stubs["stage"].pid, signal.SIGKILL)  # a stage of the second repository dies
        deadline = time.monotonic() + 60
        while server.supervisor.restarts["stage"] == 0 or not server.supervisor.ready():
            assert time.monotonic() < deadline, "the stage was not reloaded"
            time.sleep(0.2)
        assert find_stubs(server.process.pid, second)["stage"].pid != stubs["stage"].pid


def _live_processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, process group, command line) of every running, non-zombie process."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        # "pid (comm) state ppid pgrp ...": comm may hold spaces, so split after the last ")"
        state, ppid, pgid = stat.rpartition(")")[2].split()[:3]
        if state not in ("Z", "X"):
            found[int(entry.name)] = (int(ppid), int(pgid), cmdline)
    return found


def _wait_for_line(path: Path, text: str, process: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in path.read_text():
        assert process.poll() is None, f"launcher exited: {path.read_text()[-2000:]}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s"
        time.sleep(0.1)


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
            [sys.executable, "-m", "avspec.serving.launcher", "--model-repository", str(repository),
             "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
            stdout=stdout, stderr=stderr, text=True,
        )  # fmt: skip
    pgid = None
    try:
        _wait_for_line(out, "avspec: serving", launcher_process, timeout_s=120)
        processes = _live_processes()
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
            for pid, (_, g, cmd) in _live_processes().items()
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


# A stand-in server: its own session (like tritonserver), one child in its group (like a stub),
# SIGTERM answered by exiting with status 3 after 1 s, or ignored (also by the child).
_FAKE_SERVER = """
import signal, subprocess, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *_: (time.sleep(1), sys.exit(3)))
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("on_sigterm", "signals", "expected"), [("exit", 1, 3), ("ignore", 2, -9)])
def test_stop_holds_signals_a_second_one_kills_the_group(
    tmp_path: Path, on_sigterm: str, signals: int, expected: int
) -> None:
    """Signals during stop() never raise out of it: one is noted (the graceful stop goes on),
    two kill the whole group at once (long before exit_timeout_s). Handlers are restored."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    server = ServerProcess(tmp_path, exit_timeout_s=60)
    fake = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER, on_sigterm], stdout=subprocess.PIPE,
        start_new_session=True, text=True,
    )  # fmt: skip
    timers = [
        threading.Timer(0.2 * (i + 1), os.kill, (os.getpid(), signal.SIGTERM))
        for i in range(signals)
    ]
    previous = signal.signal(signal.SIGTERM, launcher._request_stop)  # as main() has it
    try:
        assert fake.stdout.readline() == "ready\n"
        server.process = fake
        for timer in timers:
            timer.start()
        started = time.monotonic()
        assert server.stop() == expected
        assert time.monotonic() - started < 10
        assert signal.getsignal(signal.SIGTERM) is launcher._request_stop
        time.sleep(0.2)  # SIGKILL is delivered asynchronously
        assert [pid for pid, (_, g, _) in _live_processes().items() if g == fake.pid] == []
    finally:
        for timer in timers:  # none may fire once pytest's own SIGTERM handling is back
            timer.cancel()
            if timer.is_alive():
                timer.join()
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fake.pid, signal.SIGKILL)
        fake.wait()
