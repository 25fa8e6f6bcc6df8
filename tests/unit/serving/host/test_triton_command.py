"""The tritonserver command line (avspec.serving.host.triton_command)."""

from __future__ import annotations

from pathlib import Path

from avspec.serving.host.settings import ModelSettings, TritonSettings
from avspec.serving.host.triton_command import TritonCommand


def _command(backend_directory: Path | None = None, **models) -> TritonCommand:
    """The command on /r/one and /r/two, with ModelSettings' `models` options."""
    return TritonCommand(
        binary=Path("/opt/tritonserver/bin/tritonserver"),
        models=ModelSettings((Path("/r/one"), Path("/r/two")), **models),
        server=TritonSettings(exit_timeout_s=30),
        run_dir=Path("/run/x"),
        metrics_port=9,
        shm_region_prefix="avspec42_",
        backend_directory=backend_directory,
    )


def test_sockets_metrics_and_regions() -> None:
    command = _command()
    argv = command.argv()
    assert argv[0] == "/opt/tritonserver/bin/tritonserver"
    assert argv[1:3] == ["--model-repository=/r/one", "--model-repository=/r/two"]
    assert (
        "--http-address=unix:/run/x/http.sock" in argv and command.http_socket.name == "http.sock"
    )
    # Triton listens on "<address>:<port>" for gRPC: the socket the front dials
    assert "--grpc-address=unix:/run/x/grpc" in argv and "--grpc-port=1" in argv
    assert command.grpc_socket == Path("/run/x/grpc:1")
    assert "--metrics-address=127.0.0.1" in argv and "--metrics-port=9" in argv
    assert "--backend-config=python,shm-region-prefix-name=avspec42_" in argv
    assert "--load-model=*" in argv and "--model-control-mode=explicit" in argv
    assert not any(a.startswith(("--backend-directory", "--model-config-name")) for a in argv)


def test_load_list_backends_and_config_name() -> None:
    argv = _command(
        load_models=["a", "b"], backend_directory=Path("/b"), model_config_name="gpu"
    ).argv()
    assert [a for a in argv if a.startswith("--load-model")] == ["--load-model=a", "--load-model=b"]
    assert "--backend-directory=/b" in argv and "--model-config-name=gpu" in argv
