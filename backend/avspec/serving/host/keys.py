"""The operator's admin key and the API keys: read once, kept in memory only.

Read from --admin-key-file / AVSPEC_ADMIN_KEY and --api-key-file / AVSPEC_API_KEYS
(avspec.serving.exposure), whose variables are then removed from the environment so no child
inherits them. Started as root, the launcher re-executes itself in the sandbox
(avspec.serving.host.reexec); the keys cross that exec through an inherited pipe
(`pipe_secrets`), never argv or environ, and the sandboxed launcher reads the pipe to its end
and closes it (`read_secrets`).
"""

from __future__ import annotations

import json
import os
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

from avspec.serving.exposure import ADMIN_KEY_ENV, API_KEYS_ENV, read_admin_key, read_api_keys

ADMIN_KEY_FD_ENV = "AVSPEC_ADMIN_KEY_FD"  # the pipe holding the keys across the sandbox's exec


@dataclass(frozen=True)
class Secrets:
    """The operator's admin key and the API keys (never in a repr)."""

    admin_key: str | None = field(default=None, repr=False)
    api_keys: tuple[tuple[str, str], ...] = field(default=(), repr=False)


def read_secrets(
    admin_key_file: Path | None, api_key_file: Path | None, environ: MutableMapping[str, str]
) -> Secrets:
    """The keys: from the sandbox's pipe (named in `environ`), else the files or `environ`'s
    variables. The variables are removed from `environ`, and the pipe is read and closed."""
    fd = environ.pop(ADMIN_KEY_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "r") as pipe:
            given = json.loads(pipe.read())
        admin = given["admin_key"]
        return Secrets(
            read_admin_key(None, {ADMIN_KEY_ENV: admin}) if admin else None,
            tuple((name, key) for name, key in given["api_keys"]),
        )
    secrets = Secrets(
        read_admin_key(admin_key_file, dict(environ)), read_api_keys(api_key_file, dict(environ))
    )
    environ.pop(ADMIN_KEY_ENV, None)
    environ.pop(API_KEYS_ENV, None)
    return secrets


def pipe_secrets(secrets: Secrets) -> int:
    """An inheritable pipe's read end holding `secrets` (read back by `read_secrets`)."""
    read_end, write_end = os.pipe()
    given = {"admin_key": secrets.admin_key, "api_keys": [list(k) for k in secrets.api_keys]}
    os.write(write_end, json.dumps(given).encode())  # within a pipe's buffer (64 KiB)
    os.close(write_end)
    os.set_inheritable(read_end, True)
    return read_end
