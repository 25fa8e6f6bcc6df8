"""FrontConfig: where the front listens, where Triton is, and what the front lets through."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from avspec.serving.front.schema import DEFAULT_GENERATE_SCHEMA, GenerateSchema

_HEADER_SAFE = re.compile(r"[\x21-\x7e]+")


@dataclass(frozen=True)
class Access:
    """Who may use the front, and how far a client's text may go (docs/serving.md, security).

    api_keys: (name, key) pairs. With keys, every call but health and the page needs
    `Authorization: Bearer KEY` (gRPC: metadata `authorization`), an unknown key gets 401, and
    the key's name is the client's identity for fairness and limits; without keys, the address.
    allowed_hosts: `Host` names accepted besides IP literals and localhost (DNS rebinding: a
    page on a name that resolves to this machine is refused); "*" accepts any.
    completions_special_tokens: a /v1/completions prompt may spell special tokens (otherwise
    it is text like a chat message's content).
    """

    api_keys: tuple[tuple[str, str], ...] = ()
    allowed_hosts: tuple[str, ...] = ()
    completions_special_tokens: bool = False

    def __post_init__(self) -> None:
        names = [name for name, _ in self.api_keys]
        if len(set(names)) != len(names) or len({k for _, k in self.api_keys}) != len(names):
            raise ValueError("API key names and keys must be distinct")
        for name, key in self.api_keys:
            if not _HEADER_SAFE.fullmatch(key) or len(key) < MIN_API_KEY:
                raise ValueError(
                    f"API key {name!r} must be at least {MIN_API_KEY} printable ASCII "
                    "characters without spaces"
                )


MIN_API_KEY = 8


@dataclass(frozen=True)
class FrontConfig:
    """Where the front listens, where Triton is, and what the front lets through."""

    host: str  # public bind address (an IP literal), e.g. "0.0.0.0" or "127.0.0.1"
    http_port: int  # public HTTP port; 0 picks a free one (see Front.http_port)
    grpc_port: int  # public gRPC port; 0 picks a free one
    upstream_http: str  # tritonserver's HTTP: "unix:/path/of/socket" or "HOST:PORT"
    upstream_grpc: str  # tritonserver's gRPC: "unix:/path/of/socket" or "HOST:PORT"
    admin_key: str | None = None  # operator key; None closes the admin API at the front
    public_models: tuple[str, ...] = ("speculative",)
    # the other models the server loads: named, they are refused as internal (403); any other
    # name is unknown (404)
    internal_models: tuple[str, ...] = ()
    # tritonserver's metrics ("HOST:PORT", loopback) and the public port that serves only its
    # /metrics (0 picks a free one); None serves no metrics port
    upstream_metrics: str | None = None
    metrics_port: int = 0
    generate_schema: GenerateSchema = field(default_factory=lambda: DEFAULT_GENERATE_SCHEMA)
    max_body_bytes: int = 1 << 20
    ready: Callable[[], bool] | None = None  # extra readiness; False -> not ready
    # a request head (request line and fields): Triton 2.51 breaks on heads past about 8.1 KB,
    # and the front adds its identity header and Host upstream
    max_header_bytes: int = 7 << 10
    read_timeout_s: float = 30.0  # for a request's body, and each write to a client
    # for a request head, from the connection's start or its previous answer: an idle socket
    # holds a connection slot no longer than this (idle floods are how slots ran out)
    header_timeout_s: float = 5.0
    connect_timeout_s: float = 5.0  # for the upstream connection
    # concurrent HTTP connections, and concurrent gRPC calls: more than 16 addresses can hold
    # at their caps (16 x 128 = 2,048), so an idle flood from a few addresses cannot fill it
    max_connections: int = 4096
    # HTTP connections, and gRPC streams, from one IP address at once (front.limits): one
    # attacker opens many from one address; 128 leaves a client its 64 running and 64 queued
    max_per_address: int = 128
    # a gRPC stream that has sent no request this long after it opened is ended (streams that
    # never send anything are how idle streams locked everyone out)
    stream_first_request_timeout_s: float = 30.0
    # a stream that has been used is ended once it has had no request in progress this long:
    # long enough for a client that keeps one stream between bursts (Envoy's default is 5 min)
    stream_idle_timeout_s: float = 300.0
    # the pair's target directory (tokenizer.json, tokenizer_config.json with its chat
    # template): the OpenAI routes decode, count and template with it; None: they answer 501
    tokenizer_dir: Path | None = None
    access: Access = field(default_factory=Access)

    def __post_init__(self) -> None:
        if self.admin_key is not None and not _HEADER_SAFE.fullmatch(self.admin_key):
            raise ValueError("admin_key must be non-empty printable ASCII without spaces")
        for name in ("upstream_http", "upstream_grpc", "upstream_metrics"):
            if getattr(self, name) is not None:
                upstream_address(getattr(self, name))
        if self.max_body_bytes <= 0 or self.max_header_bytes <= 0 or self.max_connections <= 0:
            raise ValueError("max_body_bytes, max_header_bytes and max_connections must be > 0")
        if self.header_timeout_s <= 0:
            raise ValueError("header_timeout_s must be > 0")
        if self.max_per_address <= 0 or not (
            self.stream_idle_timeout_s > 0 and self.stream_first_request_timeout_s > 0
        ):
            raise ValueError("max_per_address and the stream timeouts must be > 0")


UNIX_PREFIX = "unix:"


def upstream_address(address: str) -> tuple[str, int] | str:
    """The socket path of "unix:/path", or ("host", port) of "host:port" / "[v6]:port".

    ValueError for anything else. tritonserver listens on Unix sockets in a directory only its
    user may enter (avspec.serving.host.server_process); host:port serves the tests' fake servers.
    """
    if address.startswith(UNIX_PREFIX):
        path = address[len(UNIX_PREFIX) :]
        if not path.startswith("/"):
            raise ValueError(f"upstream address {address!r} is not unix:/ABSOLUTE/PATH")
        return path
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"upstream address {address!r} is not HOST:PORT or unix:/PATH")
    return host.strip("[]"), int(port)
