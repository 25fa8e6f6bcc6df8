"""What a client, and a local user, can reach (docs/serving.md, docs/reliability.md).

Exposure model: tritonserver has no TCP port a client or another local user can reach. Its HTTP
and gRPC endpoints are Unix sockets in a directory only the server's user may enter
(avspec.serving.host.server_process), its metrics a loopback port; it runs as a dedicated non-root
user (avspec.serving.host.sandbox) with private shared memory. The public ports belong to the front
(avspec.serving.front), which routes inference on the public model, health, metadata and
/metrics, and nothing else. Because only the front reaches Triton, no key guards Triton itself:
no secret is on any command line, in any file or in any environment another user can read.
The admin APIs (model control, repository, configuration, statistics, trace, logging, shared
memory) open at the front only with the operator's key (`--admin-key-file` or
AVSPEC_ADMIN_KEY), held in the launcher's memory; without it no admin key exists at all.
Optional API keys (`--api-key-file` or AVSPEC_API_KEYS) make the inference routes need a key, and
each key's name the client's identity; they are held the same way.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

ADMIN_KEY_HEADER = "avspec-admin-key"
CLIENT_HEADER = "avspec-client"  # the caller's identity, set by the front (fairness, refit share)
GRPC_RESTRICTED_PREFIX = "triton-grpc-protocol-"
ADMIN_KEY_ENV = "AVSPEC_ADMIN_KEY"
API_KEYS_ENV = "AVSPEC_API_KEYS"


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


def triton_flags() -> list[str]:
    """tritonserver options of the exposure model: the caller's identity reaches the model."""
    # gRPC metadata reaches the model as a request parameter; over HTTP the front puts the
    # identity into the generate body, where Triton 2.51 makes it a parameter too
    return [f"--grpc-header-forward-pattern={CLIENT_HEADER}"]


def read_api_keys(
    path: Path | None, environ: dict[str, str] | None = None
) -> tuple[tuple[str, str], ...]:
    """The API keys as (name, key) pairs: from a file (a key a line, `NAME KEY` or `KEY`; blank
    lines and `#` comments skipped) or AVSPEC_API_KEYS (entries separated by commas, the same
    forms); () when neither. A key without a name is named by the start of its sha256 (names
    appear in logs and metrics; keys never do). ValueError naming a malformed entry."""
    environ = dict(os.environ) if environ is None else environ
    if path is not None:
        entries, source = Path(path).read_text().splitlines(), str(path)
    elif environ.get(API_KEYS_ENV):
        entries, source = environ[API_KEYS_ENV].split(","), API_KEYS_ENV
    else:
        return ()
    keys = []
    for number, entry in enumerate(entries, 1):
        words = entry.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{source}: entry {number} is not 'NAME KEY' or 'KEY'")
        key = words[-1]
        name = words[0] if len(words) == 2 else hashlib.sha256(key.encode()).hexdigest()[:8]
        keys.append((name, key))
    if not keys:
        raise ValueError(f"{source} holds no API key")
    return tuple(keys)
