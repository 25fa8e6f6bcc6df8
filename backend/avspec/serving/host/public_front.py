"""The front that guards a server: its configuration from the settings and the run directory.

The front (avspec.serving.front) holds the public HTTP, gRPC and metrics ports; it relays to
tritonserver's Unix sockets in the run directory and to its loopback metrics port, lets clients
run the public model only, and takes the generate body's schema and the OpenAI routes'
tokenizer from that model's configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

from avspec.serving.front import FrontConfig, generate_schema_from_config
from avspec.serving.host.served_models import model_config_file
from avspec.serving.host.settings import ServeSettings
from avspec.serving.host.triton_command import grpc_socket, http_socket
from avspec.serving.repository import served_tokenizer_dir


def front_config(
    settings: ServeSettings,
    models: Sequence[str],
    public_home: Path,
    run_dir: Path,
    internal_metrics_port: int,
    ready: Callable[[], bool],
) -> FrontConfig:
    """The front of a server loading `models`, the public one from the repository
    `public_home`, with its sockets in `run_dir`; `ready` is its readiness gate."""
    network, public = settings.network, settings.models.public_model
    model_dir = public_home / public
    config_file = model_config_file(model_dir, settings.models.model_config_name)
    return FrontConfig(
        host=network.host,
        http_port=network.http_port,
        grpc_port=network.grpc_port,
        upstream_http=f"unix:{http_socket(run_dir)}",
        upstream_grpc=f"unix:{grpc_socket(run_dir)}",
        admin_key=settings.security.admin_key,
        public_models=(public,),
        internal_models=tuple(m for m in models if m != public),
        upstream_metrics=f"127.0.0.1:{internal_metrics_port}",
        metrics_port=network.metrics_port,
        generate_schema=generate_schema_from_config(config_file.read_text()),
        max_body_bytes=network.max_body_bytes,
        ready=ready,
        # the OpenAI routes decode and template with the pair's tokenizer (issue 22)
        tokenizer_dir=served_tokenizer_dir(model_dir),
        access=settings.security.access,
    )
