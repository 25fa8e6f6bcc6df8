"""FrontConfig: where the front listens, where Triton is, and what the front lets through."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from avspec.serving.front.schema import DEFAULT_GENERATE_SCHEMA, GenerateSchema

_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class FrontConfig:
    """Where the front listens, where Triton is, and what the front lets through."""

    host: str  # public bind address (an IP literal), e.g. "0.0.0.0" or "127.0.0.1"
    http_port: int  # public HTTP port; 0 picks a free one (see Front.http_port)
    grpc_port: int  # public gRPC port; 0 picks a free one
    upstream_http: str  # "127.0.0.1:PORT" of tritonserver's HTTP
    upstream_grpc: str  # "127.0.0.1:PORT" of tritonserver's gRPC
    front_key: str  # sent upstream on every forwarded call (`avspec-front-key`, see exposure)
    admin_key: str | None = None  # operator key; None closes the admin API at the front
    public_models: tuple[str, ...] = ("speculative",)
    generate_schema: GenerateSchema = field(default_factory=lambda: DEFAULT_GENERATE_SCHEMA)
    max_body_bytes: int = 1 << 20
    ready: Callable[[], bool] | None = None  # extra readiness; False -> not ready
    max_header_bytes: int = 16 << 10
    read_timeout_s: float = 30.0  # for a request's head and body, and each write to a client
    connect_timeout_s: float = 5.0  # for the upstream connection
    max_connections: int = 1024  # concurrent HTTP connections, and concurrent gRPC calls

    def __post_init__(self) -> None:
        for name in ("front_key", "admin_key"):
            value = getattr(self, name)
            if value is not None and not _HEADER_SAFE.fullmatch(value):
                raise ValueError(f"{name} must be non-empty printable ASCII without spaces")
        for name in ("upstream_http", "upstream_grpc"):
            split_host_port(getattr(self, name))
        if self.max_body_bytes <= 0 or self.max_header_bytes <= 0 or self.max_connections <= 0:
            raise ValueError("max_body_bytes, max_header_bytes and max_connections must be > 0")


def split_host_port(address: str) -> tuple[str, int]:
    """("host", port) of "host:port" or "[v6]:port"; ValueError otherwise."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"upstream address {address!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
