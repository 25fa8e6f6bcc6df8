"""What a client can reach, and the keys that guard the rest (docs/reliability.md).

Exposure model: tritonserver listens on 127.0.0.1 only, on ports of its own. The public ports
belong to the front (`avspec.serving.front`), which routes inference on the public model, health
and metadata, and nothing else; the metrics port is Triton's, read-only. Behind the front,
Triton's restricted-API options require two per-boot keys:
- the front key (header `avspec-front-key`) for the `inference` API: only the front holds it, so
  no client, remote or local, can drive the internal stage models (`draft`, `verifier`, `target`,
  `speculative_step`) even with direct access to the loopback ports;
- the admin key (header `avspec-admin-key`) for model control, repository, configuration,
  statistics, trace, logging and shared memory. The launcher always has one (the supervisor
  reloads models with it); the front forwards admin calls only when the operator chose the key
  (`--admin-key-file` or AVSPEC_ADMIN_KEY), never with the random one.
Over gRPC Triton expects the restricted headers with the prefix `triton-grpc-protocol-`.
Both keys appear on tritonserver's command line, so local users of the host who can read
/proc/<pid>/cmdline can read them: the boundary this draws is the network, not the host.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

FRONT_KEY_HEADER = "avspec-front-key"
ADMIN_KEY_HEADER = "avspec-admin-key"
CLIENT_HEADER = "avspec-client"  # the caller's identity, set by the front (fairness, refit share)
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"
ADMIN_APIS = (
    "model-repository",
    "model-config",
    "shared-memory",
    "statistics",
    "trace",
    "logging",
)
ADMIN_KEY_ENV = "AVSPEC_ADMIN_KEY"


def read_admin_key(path: Path | None, environ: dict[str, str] | None = None) -> str | None:
    """The operator's admin key from a file (first line) or AVSPEC_ADMIN_KEY; None if neither.

    ValueError for an empty or short key: a guessable key would open model control to anyone.
    """
    environ = dict(os.environ) if environ is None else environ
    if path is not None:
        key = Path(path).read_text().strip()
        source = str(path)
    elif environ.get(ADMIN_KEY_ENV):
        key, source = environ[ADMIN_KEY_ENV].strip(), ADMIN_KEY_ENV
    else:
        return None
    if len(key) < 16:
        raise ValueError(f"admin key from {source} must hold at least 16 characters")
    if any(c in key for c in ",=: \t"):
        raise ValueError(f"admin key from {source} must not contain ',', '=', ':' or spaces")
    return key


@dataclass(frozen=True)
class Keys:
    """The per-boot front key and the admin key (the operator's, else a random unpublished one)."""

    operator_admin_key: str | None = None
    front_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    random_admin_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def admin_key(self) -> str:
        return self.operator_admin_key or self.random_admin_key

    def triton_flags(self) -> list[str]:
        """tritonserver options restricting inference to the front and the rest to admins."""
        front = f"inference:{FRONT_KEY_HEADER}={self.front_key}"
        admin = f"{','.join(ADMIN_APIS)}:{ADMIN_KEY_HEADER}={self.admin_key}"
        return [
            f"--http-restricted-api={front}",
            f"--http-restricted-api={admin}",
            f"--grpc-restricted-protocol={front}",
            f"--grpc-restricted-protocol={admin}",
            # gRPC metadata reaches the model as a request parameter; over HTTP the front puts
            # the identity into the generate body, where Triton 2.51 makes it a parameter too
            f"--grpc-header-forward-pattern={CLIENT_HEADER}",
        ]
