"""The running server's pieces without a server (avspec.serving.host.server_process): which models
it loads, the tritonserver command line, and stop()'s handling of signals."""

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
from helpers import ROOT
from helpers.fake_tritonserver import fake_tritonserver
from helpers.server import live_processes

from avspec.serving.host.serve import request_stop
from avspec.serving.host.served_models import model_config_file, python_models, repository_models
from avspec.serving.host.server_process import ServerError, ServerProcess
from avspec.serving.host.settings import (
    ModelSettings,
    NetworkSettings,
    SecuritySettings,
    ServeSettings,
    TritonSettings,
)
from avspec.serving.host.triton_env import tritonserver_binary


def _settings(*repositories: Path, **models: object) -> ServeSettings:
    """The default settings on `repositories`, with ModelSettings' `models` options."""
    return ServeSettings(ModelSettings(repositories, **models))


def test_missing_or_empty_repository(tmp_path: Path) -> None:
    with pytest.raises(ServerError, match="not a directory"):
        ServerProcess(_settings(tmp_path / "absent"))
    with pytest.raises(ServerError, match="no model"):
        ServerProcess(_settings(tmp_path))
    _model(tmp_path / "repository", "m", 'backend: "python"')
    absent = TritonSettings(tritonserver=tmp_path / "absent" / "tritonserver")
    with pytest.raises(ServerError, match="not an executable"):
        ServerProcess(ServeSettings(ModelSettings((tmp_path / "repository",)), server=absent))


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
    server = ServerProcess(_settings(first, second, model_config_name="gpu"))
    assert server.models == ["adapter", "cpu_only", "engine", "entry", "pipeline"]
    assert server.supervised_models() == ["adapter", "entry"]
    assert server.model_homes["adapter"] == second.resolve()
    _model(second, "entry", 'backend: "python"')
    with pytest.raises(ServerError, match="'entry' is in several of the repositories"):
        ServerProcess(_settings(first, second))
    with pytest.raises(ServerError, match="'absent' is in none of the repositories"):
        ServerProcess(_settings(first, load_models=["entry", "absent"]))


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
    models = ModelSettings(
        (ROOT / "model_repository", ROOT / "model_repository_gpu"),  # the templates: same backends
        load_models=loads,
        model_config_name="gpu",
    )
    server = ServerProcess(
        ServeSettings(models, server=TritonSettings(tritonserver=fake_tritonserver(tmp_path)))
    )
    assert server.models == loads  # readiness waits for each
    assert server.supervised_models() == ["trtllm_target", "draft", "verifier", "speculative"]
    server.run_dir = tmp_path
    command = server.command(None)
    assert "--load-model=*" not in command and "--backend-directory" not in " ".join(command)
    assert [a for a in command if a.startswith("--load-model=")] == [
        f"--load-model={m}" for m in loads
    ]


def test_command_uses_explicit_model_control(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    server = ServerProcess(ServeSettings(ModelSettings((tmp_path,)), NetworkSettings(1, 2, 3)))
    server.run_dir, server.internal_metrics_port = tmp_path / "run", 13
    assert repository_models(tmp_path) == ["m"]
    command = server.command(tmp_path / "backends")
    assert command[0] == str(tritonserver_binary())
    assert f"--model-repository={tmp_path.resolve()}" in command
    assert f"--backend-directory={tmp_path / 'backends'}" in command
    assert "--model-control-mode=explicit" in command and "--load-model=*" in command
    assert not any(a.startswith("--model-config-name") for a in command)
    # Triton's HTTP and gRPC on Unix sockets in the run directory, its metrics on loopback;
    # the public ports are the front's
    run = tmp_path / "run"
    assert f"--http-address=unix:{run / 'http.sock'}" in command
    assert f"--grpc-address=unix:{run / 'grpc'}" in command and "--grpc-port=1" in command
    assert server.grpc_socket == run / "grpc:1"  # Triton appends the port to the address
    assert "--metrics-address=127.0.0.1" in command and "--metrics-port=13" in command
    assert server.http_url.endswith(":1") and server.metrics_url.endswith(":3/metrics")


def test_no_key_on_the_command_line(tmp_path: Path) -> None:
    """Any local user reads /proc/<pid>/cmdline: neither the operator's key nor any other
    secret is there, and Triton restricts nothing by key (only the front reaches it)."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.pbtxt").write_text('backend: "python"')
    security = SecuritySettings(admin_key="operator-key-0123456789")
    server = ServerProcess(ServeSettings(ModelSettings((tmp_path,)), security=security))
    server.run_dir = tmp_path / "run"
    command = server.command(tmp_path / "backends")
    assert "operator-key-0123456789" not in " ".join(command)
    assert not [a for a in command if a.startswith(("--http-restricted", "--grpc-restricted"))]


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
    server = ServerProcess(
        ServeSettings(ModelSettings((tmp_path,)), server=TritonSettings(exit_timeout_s=60))
    )
    fake = subprocess.Popen(
        [sys.executable, "-c", _FAKE_SERVER, on_sigterm], stdout=subprocess.PIPE,
        start_new_session=True, text=True,
    )  # fmt: skip
    timers = [
        threading.Timer(0.2 * (i + 1), os.kill, (os.getpid(), signal.SIGTERM))
        for i in range(signals)
    ]
    previous = signal.signal(signal.SIGTERM, request_stop)  # as the launcher's main() has it
    try:
        assert fake.stdout.readline() == "ready\n"
        server.process = fake
        for timer in timers:
            timer.start()
        started = time.monotonic()
        assert server.stop() == expected
        assert time.monotonic() - started < 10
        assert signal.getsignal(signal.SIGTERM) is request_stop
        time.sleep(0.2)  # SIGKILL is delivered asynchronously
        assert [pid for pid, (_, g, _) in live_processes().items() if g == fake.pid] == []
    finally:
        for timer in timers:  # none may fire once pytest's own SIGTERM handling is back
            timer.cancel()
            if timer.is_alive():
                timer.join()
        signal.signal(signal.SIGTERM, previous)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(fake.pid, signal.SIGKILL)
        fake.wait()
