"""The launcher's pieces, and its failure path against a real (broken) server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
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
    assert repository_models(tmp_path) == ["m"]
    command = server.command(tmp_path / "backends")
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert "--http-port=1" in command and "--metrics-port=3" in command
    assert server.http_url.endswith(":1") and server.metrics_url.endswith(":3/metrics")


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
    model = tmp_path / "echo"
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "python"\nmax_batch_size: 0\n'
        'input [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
        'output [ { name: "x" data_type: TYPE_FP32 dims: [ 1 ] } ]\n'
    )
    (model / "1" / "model.py").write_text(
        "class TritonPythonModel:\n" "    def execute(self, requests):\n" "        return []\n"
    )
    ports = [str(free_port()) for _ in range(3)]
    process = subprocess.Popen(
        [sys.executable, "-m", "avspec.serving.launcher", "--model-repository", str(tmp_path),
         "--http-port", ports[0], "--grpc-port", ports[1], "--metrics-port", ports[2]],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        line = process.stdout.readline()
        assert line.strip() == (
            f"avspec: serving 1 models, HTTP :{ports[0]} gRPC :{ports[1]} metrics :{ports[2]}"
        )
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "stopped on SIGTERM" in process.stdout.read()
    finally:
        if process.poll() is None:
            process.kill()
