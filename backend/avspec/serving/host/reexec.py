"""Started as root: the launcher executes itself again inside the sandbox, as the server's user.

The server's user (`--user`, default uid/gid 10001) is given its snapshot directories and this
host's cost cache first (that needs root); then the front, tritonserver and every stub run
unprivileged, with a private /dev/shm (avspec.serving.host.sandbox). The keys cross the exec
through an inherited pipe (avspec.serving.host.keys), never argv or environ.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from avspec.serving.host.host_costs import cache_directory
from avspec.serving.host.keys import ADMIN_KEY_FD_ENV, Secrets, pipe_secrets
from avspec.serving.host.sandbox import ServerUser, sandbox_command
from avspec.serving.host.served_models import locate_models, repository_models
from avspec.serving.host.server_files import grant_writable, sandbox_paths, server_files
from avspec.serving.host.settings import ServeSettings


def reexec_sandboxed(settings: ServeSettings, user: ServerUser) -> None:
    """Give `user` its snapshot directories, then execute this launcher again inside the
    sandbox as `user`, with the same arguments (`settings.argv`) and the keys in an inherited
    pipe. Returns only by raising (OSError).

    The snapshot paths of a repository copy (avspec.serving.host.served_repository) are the
    original's, made absolute against the same root, so granting the originals' is enough.
    """
    repositories = list(settings.models.repositories)
    models = [m for r in repositories for m in repository_models(r)]
    config_name = settings.models.model_config_name
    files = server_files(repositories, locate_models(repositories, models), config_name)
    costs = cache_directory(settings.costs.cache)  # this host's cost tables, written by `user`
    writable = [*files.writable, costs]
    grant_writable(writable, user)
    pair, server = settings.pair, settings.server
    given = (pair.draft_model, pair.target_model, server.tritonserver, server.backend_directory,
             settings.costs.tables)  # fmt: skip
    expose = sandbox_paths(files, Path.cwd(), *(Path(p).resolve() for p in given if p))
    secrets = settings.security.secrets()
    if secrets != Secrets():
        os.environ[ADMIN_KEY_FD_ENV] = str(pipe_secrets(secrets))
    launcher = [sys.executable, "-m", "avspec.serving.host.launcher", *settings.argv]
    print(f"avspec: dropping root: the server runs as uid {user.uid}, gid {user.gid}", flush=True)
    launcher += ["--cost-cache", str(costs)]
    command = sandbox_command(launcher, user, expose, writable)
    os.execv(command[0], command)
