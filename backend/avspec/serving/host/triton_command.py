"""The tritonserver command line of the deployment (avspec.serving.host.server_process runs it).

Everything here is the exposure model in flags: HTTP and gRPC on Unix sockets in the run
directory (Triton appends its port to a gRPC address, so the socket is `<grpc address>:<port>`),
metrics on loopback for the front to relay, models loaded in explicit control mode, and the
Python backend's shared-memory regions named after the launcher so a later start can tell its
leftovers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from avspec.serving.exposure import triton_flags
from avspec.serving.host.settings import ModelSettings, TritonSettings

GRPC_SOCKET_PORT = 1  # Triton names its gRPC socket "<address>:<port>"; otherwise unused


def http_socket(run_dir: Path) -> Path:
    """tritonserver's HTTP socket in `run_dir`."""
    return run_dir / "http.sock"


def grpc_socket(run_dir: Path) -> Path:
    """tritonserver's gRPC socket in `run_dir` (Triton appends the port to the address given)."""
    return run_dir / f"grpc:{GRPC_SOCKET_PORT}"


@dataclass(frozen=True)
class TritonCommand:
    """What the command line says; `argv()` writes it.

    `models`: the repositories, the config name and the models to load (None: every model of
    the repositories); `server`: the exit timeout and verbosity.
    """

    binary: Path
    models: ModelSettings
    server: TritonSettings
    run_dir: Path  # the sockets' directory
    metrics_port: int  # on 127.0.0.1
    shm_region_prefix: str
    backend_directory: Path | None = None  # None: tritonserver's own default

    @property
    def http_socket(self) -> Path:
        return http_socket(self.run_dir)

    @property
    def grpc_socket(self) -> Path:
        return grpc_socket(self.run_dir)

    def argv(self) -> list[str]:
        models = self.models
        if models.load_models is None:
            loads = ["--load-model=*"]
        else:
            loads = [f"--load-model={model}" for model in models.load_models]
        backends = self.backend_directory
        config_name = models.model_config_name
        return [
            str(self.binary),
            *(f"--model-repository={r}" for r in models.repositories),
            *([f"--backend-directory={backends}"] if backends else []),
            *([f"--model-config-name={config_name}"] if config_name else []),
            "--model-control-mode=explicit",
            *loads,
            "--disable-auto-complete-config",  # config.pbtxt is complete; saves a stub per model
            f"--http-address=unix:{self.http_socket}",
            "--http-port=1",  # unused for a Unix socket, but must be valid
            f"--grpc-address=unix:{self.run_dir / 'grpc'}",
            f"--grpc-port={GRPC_SOCKET_PORT}",
            *triton_flags(),
            "--allow-metrics=true",
            "--metrics-address=127.0.0.1",
            f"--metrics-port={self.metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_region_prefix}",
            f"--exit-timeout-secs={self.server.exit_timeout_s}",
            f"--log-verbose={self.server.log_verbose}",
        ]
