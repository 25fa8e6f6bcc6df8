"""The launcher's pieces, and its failure path against a real (broken) server."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import free_port

from avspec.serving import launcher
from avspec.serving.launcher import (
    ServerError,
    ServerProcess,
    prepare_backend_directory,
    repository_models,
    server_environment,
)


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
    assert str(launcher.BACKEND_SOURCE_DIR) in env["PYTHONPATH"]
    assert "OMP_NUM_THREADS" not in server_environment({}, cpu_threads=None)


def test_missing_or_empty_repository(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="not a directory"):
        ServerProcess(tmp_path / "absent")
    with pytest.raises(ServerError, match="no model"):
        ServerProcess(tmp_path)


def test_command_uses_explicit_model_control(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    server = ServerProcess(tmp_path, 1, 2, 3)
    server.internal_http_port, server.internal_grpc_port = 11, 12
    assert repository_models(tmp_path) == ["m"]
    command = server.command(tmp_path / "backends")
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
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


def _echo_repository(root: Path) -> Path:
    """A one-model repository whose Python model loads instantly (one stub process).

    Named `speculative`, the public model the launcher's front serves by default.
    """
    model = root / "speculative"
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
