"""What the server's user is given on the file system: read access to the repositories and the
models, write access to the estimator's snapshot directory, and nothing more.

Started as root, tritonserver and its stubs run as a dedicated user (avspec.serving.host.sandbox).
Before it starts, the launcher makes the snapshot directories that user's (the only place the
server writes, beside its private run directory), and checks, as that user, that every model
repository and every path a model reads (model_dir, cost_tables) is readable, so a checkout the
user cannot read fails at once with the paths named, not later inside a stub.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from avspec.serving.host.sandbox import ServerUser, runtime_paths, sandbox_command
from avspec.serving.host.served_models import model_config_file
from avspec.serving.host.triton_env import BACKEND_SOURCE_DIR
from avspec.serving.repository import is_path_value, read_config_parameters, resolve_path

READ_PARAMETERS = ("model_dir", "cost_tables")
WRITE_PARAMETERS = ("snapshot_path",)

_MODE_DIR = os.R_OK | os.X_OK
# Run as the server's user: print each argument that user cannot read (a directory: list and
# enter; a file: read).
_CHECK = (
    "import os, sys\n"
    "for p in sys.argv[1:]:\n"
    "    mode = os.R_OK | os.X_OK if os.path.isdir(p) else os.R_OK\n"
    "    if not os.access(p, mode): print(p)\n"
)


@dataclass(frozen=True)
class ServerFiles:
    """The paths the served models read, and the directories they write."""

    readable: tuple[Path, ...]
    writable: tuple[Path, ...]


def server_files(
    repositories: Iterable[Path], model_homes: Mapping[str, Path], config_name: str | None
) -> ServerFiles:
    """The repositories and each model's path parameters (relative ones against the project
    root, the repository's parent, as the stages resolve them)."""
    readable: list[Path] = list(repositories)
    writable: list[Path] = []
    for model, home in model_homes.items():
        config = model_config_file(home / model, config_name)
        parameters = read_config_parameters(config.read_text())
        for name, value in parameters.items():
            if not is_path_value(name, value):
                continue
            path = resolve_path(home.parent, value)
            if name in READ_PARAMETERS:
                readable.append(path)
            elif name in WRITE_PARAMETERS:
                writable.append(path.parent)
    return ServerFiles(tuple(dict.fromkeys(readable)), tuple(dict.fromkeys(writable)))


def sandbox_paths(files: ServerFiles, *extra: Path) -> list[Path]:
    """What the server's sandbox shows its user, read-only: the Python installation and
    environment, the `avspec` sources, every path a model reads, and `extra`."""
    return [*runtime_paths(), BACKEND_SOURCE_DIR, *files.readable, *extra]


def grant_writable(directories: Iterable[Path], user: ServerUser) -> None:
    """Create each directory and give it (and the files directly in it) to `user`."""
    for directory in directories:
        directory.mkdir(parents=True, exist_ok=True)
        for path in (directory, *directory.iterdir()):
            if path.is_file() or path == directory:
                os.chown(path, user.uid, user.gid)


def unreadable(
    paths: Iterable[Path],
    user: ServerUser | None,
    expose: Iterable[Path] = (),
    writable: Iterable[Path] = (),
) -> list[str]:
    """The paths `user` cannot read (a directory: list and enter; a file: read). For a user to
    drop to, checked by a short child process running as `user` in the sandbox the server gets
    (avspec.serving.host.sandbox: `expose` made reachable); for None, as this process."""
    names = [str(p) for p in paths if p.exists()]  # a missing path is the stages' to report
    if user is None:
        return [n for n in names if not os.access(n, _MODE_DIR if os.path.isdir(n) else os.R_OK)]
    if not names:
        return []
    result = subprocess.run(
        sandbox_command(
            [sys.executable, "-I", "-c", _CHECK, *names],
            user,
            [*runtime_paths(), *expose],  # the checker is Python too
            list(writable),
        ),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        # the user cannot even start Python from here: the interpreter itself is out of reach
        return [sys.executable]
    return result.stdout.split()
