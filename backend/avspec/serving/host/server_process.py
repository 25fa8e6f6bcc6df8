"""A tritonserver on model repositories, behind the front, with a stage supervisor.

Safe by default (avspec.serving.exposure): tritonserver's HTTP and gRPC are Unix sockets in a
private run directory only the server's user may enter, its metrics a loopback port; the front
(avspec.serving.front) alone holds the public HTTP, gRPC and metrics ports and routes inference
on `speculative`, health, metadata and /metrics; model control and the other admin APIs open
only with the operator's admin key. Started as root, tritonserver and its stubs run as a
dedicated user with private shared memory (avspec.serving.host.sandbox), given read access to the
repositories and models and write access to the snapshot directory only
(avspec.serving.host.server_files). A supervisor (avspec.serving.host.supervisor) reloads a
model whose stub died; `restart()` starts a dead tritonserver again while the front keeps its ports.
Models are loaded in explicit control mode (`--load-model=*`, or the models given), so an
operator with the key may unload and reload single models (the serving tests do this to prove
warm start).

Which server (avspec.serving.host.triton_env): by default the one bundled in nvidia-pytriton on one
repository (the CPU deployment). The GPU container (docker/serve_gpu.sh) passes its installed
tritonserver and backend directory, two repositories, `--model-config-name=gpu` and the models
to load; the exposure is the same.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

from avspec.serving.front import Front
from avspec.serving.host.cleanup import clean_leftovers, remove_regions, shm_prefix
from avspec.serving.host.process_group import kill_group, signals_held, terminate
from avspec.serving.host.public_front import front_config
from avspec.serving.host.sandbox import ServerUser, sandbox_command, server_user
from avspec.serving.host.served_models import models_to_load, runs_on_python_backend
from avspec.serving.host.server_files import grant_writable, sandbox_paths, server_files, unreadable
from avspec.serving.host.settings import ServeSettings
from avspec.serving.host.supervisor import StageHooks, StageSupervisor
from avspec.serving.host.triton_api import TritonAPI, TritonAPIError
from avspec.serving.host.triton_command import TritonCommand, grpc_socket, http_socket
from avspec.serving.host.triton_env import TritonInstall, prepare_backend_directory


class ServerError(RuntimeError):
    """The server could not be started, died, or never became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running tritonserver on model repositories; use as a context manager.

    `start()` returns once every model to load is ready and the front listens, or raises
    ServerError (server exited, or not ready within the settings' `ready_timeout_s`). `stop()`
    sends SIGTERM, then SIGKILL to the whole process group after `exit_timeout_s` + 10 s.

    Everything comes from `settings` (avspec.serving.host.settings.ServeSettings): the front's
    public ports on `network.host` (tritonserver's own HTTP and gRPC are Unix sockets in the run
    directory, `triton_api`, its metrics a free loopback port); the front's `security.access`
    and the operator's `security.admin_key` (None: the admin APIs stay closed); who
    tritonserver runs as when started by root (`security.user`; ignored otherwise); which
    server (`server`) and what it loads (`models`). The supervisor watches the loaded
    Python-backend models of every repository. `http_port`, `grpc_port` and `metrics_port`
    are the ports the front listens on once started (a 0 in the settings: a free one).
    """

    def __init__(self, settings: ServeSettings) -> None:
        self.settings = settings
        try:
            self.user: ServerUser | None = server_user(settings.security.user)
        except ValueError as err:
            raise ServerError(str(err)) from None
        self.model_repositories = settings.models.repositories
        self.model_repository = self.model_repositories[0]
        self.load_models = settings.models.load_models
        try:
            self.models, self.model_homes = models_to_load(
                self.model_repositories, self.load_models
            )
        except ValueError as err:
            raise ServerError(str(err)) from None
        self.model_config_name = settings.models.model_config_name
        try:
            self.triton = TritonInstall.find(
                settings.server.tritonserver, settings.server.backend_directory
            )
        except ImportError as err:
            raise ServerError(f"{err}: the bundled tritonserver needs nvidia-pytriton") from None
        except FileNotFoundError as err:
            raise ServerError(str(err)) from None
        network = settings.network
        self.http_port, self.grpc_port = network.http_port, network.grpc_port
        self.metrics_port = network.metrics_port
        self.internal_metrics_port = 0
        self.process: subprocess.Popen | None = None
        self.front: Front | None = None
        self.supervisor: StageSupervisor | None = None
        self.run_dir: Path | None = None  # sockets, backends, HOME; the server user's alone
        self._backends: Path | None = None
        self._serving = False  # tritonserver up and every model ready (False while restarting)
        self._exposed: list[Path] = []  # what the server's user is shown in its sandbox
        self._writable: list[Path] = []  # ... and may write there (the snapshot directories)

    @property
    def host(self) -> str:
        """The address of the front's public ports."""
        return self.settings.network.host

    @property
    def public_model(self) -> str:
        return self.settings.models.public_model

    @property
    def admin_key(self) -> str | None:
        return self.settings.security.admin_key

    @property
    def max_body_bytes(self) -> int:
        return self.settings.network.max_body_bytes

    @property
    def log_path(self) -> Path | None:
        """tritonserver's log (None: this process's output)."""
        return self.settings.server.log_path

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def http_socket(self) -> Path:
        """tritonserver's own HTTP endpoint, a Unix socket only the server's user may open."""
        return http_socket(self._run_path())

    @property
    def grpc_socket(self) -> Path:
        """tritonserver's own gRPC endpoint (Triton appends the port to the address given)."""
        return grpc_socket(self._run_path())

    @property
    def triton_api(self) -> TritonAPI:
        """tritonserver's HTTP API on its socket (readiness, model reloads)."""
        return TritonAPI(str(self.http_socket))

    def _run_path(self) -> Path:
        if self.run_dir is None:
            raise ServerError("server not started")
        return self.run_dir

    def command(self, backend_directory: Path | None) -> list[str]:
        """Return the tritonserver command line (no `--backend-directory` for None)."""
        return TritonCommand(
            binary=self.triton.binary,
            models=self.settings.models,
            server=self.settings.server,
            run_dir=self._run_path(),
            metrics_port=self.internal_metrics_port,
            # regions named after this launcher, so the next start can tell its leftovers
            shm_region_prefix=shm_prefix(os.getpid()),
            backend_directory=backend_directory,
        ).argv()

    def start(self) -> ServerProcess:
        """Start the server and wait until every model is ready."""
        if self.process is not None:
            raise ServerError("server already started")
        try:
            clean_leftovers()
            self.prepare_files()
            self.run_dir = Path(tempfile.mkdtemp(prefix="avspec-run-"))
            self._backends = self._prepare_backends(self.run_dir)
            if self._drops_privileges:
                assert self.user is not None  # _drops_privileges: a user is set
                os.chown(self.run_dir, self.user.uid, self.user.gid)
            self.internal_metrics_port = free_port()
            self._launch()
            self.wait_ready()
            self._start_supervisor()
            self._serving = True
            self._start_front()
        except BaseException:
            self.stop()
            raise
        return self

    @property
    def _drops_privileges(self) -> bool:
        """Whether tritonserver is started as root and must drop to `user`."""
        return self.user is not None and os.geteuid() == 0

    def prepare_files(self) -> None:
        """Give the server's user its snapshot directories; check it can read the rest.

        Run as root before the launcher drops its own privileges (the chown needs root), and
        again by `start` (then a check only). ServerError names every path it cannot read.
        """
        files = server_files(self.model_repositories, self.model_homes, self.model_config_name)
        triton = [self.triton.binary.parent, self.triton.backend_directory]
        self._exposed = sandbox_paths(files, *(p for p in triton if p is not None))
        self._writable = list(files.writable)
        user = self.user if self._drops_privileges else None
        if user is not None:
            grant_writable(files.writable, user)
        missing = unreadable(files.readable, user, self._exposed, self._writable)
        if missing:
            who = f"user {self.user}" if self._drops_privileges else f"uid {os.geteuid()}"
            raise ServerError(
                f"the server's {who} cannot read {', '.join(missing)}: make them readable "
                "(chmod -R o+rX, and o+x on every directory above) or choose --user"
            )

    def _prepare_backends(self, run_dir: Path) -> Path | None:
        """The backend directory to pass (None: tritonserver's own default)."""
        if not self.triton.assembles_backends:
            return self.triton.backend_directory
        try:
            return prepare_backend_directory(run_dir / "backends")
        except FileNotFoundError as err:
            raise ServerError(str(err)) from None

    def _launch(self) -> None:
        environment = self.triton.environment(self.settings.server.cpu_threads)
        if self._drops_privileges:
            environment["HOME"] = str(self.run_dir)  # root's home is not the server user's
        # through the sandbox (a no-op but for the parent-death signal when the launcher is in
        # one already): tritonserver dies with this process, even when it is SIGKILLed
        user = self.user if self._drops_privileges else None
        command = sandbox_command(
            self.command(self._backends),
            user,
            self._exposed,
            self._writable,
            die_with_parent=True,
        )
        out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        try:
            self.process = subprocess.Popen(
                command,
                env=environment,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
                start_new_session=True,  # own process group: stop() reaches the stub processes
            )
        finally:
            if out is not None:
                out.close()

    def supervised_models(self) -> list[str]:
        """The models to load that the Python backend runs (those have stubs to watch)."""
        return [
            model
            for model in self.models
            if runs_on_python_backend(self.model_homes[model] / model, self.model_config_name)
        ]

    def _stub_root(self) -> Path:
        # The supervisor keeps tritonserver's stub children whose model file lies under one
        # directory. With several repositories their common ancestor holds every one; it admits
        # no foreign stub: only this server's children are considered, and Triton refuses a
        # model name found in two repositories.
        return Path(os.path.commonpath(self.model_repositories))

    def _start_supervisor(self) -> None:
        if not self.settings.server.supervise:
            return
        supervised = self.supervised_models()
        assert self.process is not None  # started before its supervisor
        self.supervisor = StageSupervisor(
            self.process.pid,
            self._stub_root(),
            supervised,
            StageHooks(
                reload=self.reload_model,
                is_loaded=lambda model: self.triton_api.ok(f"/v2/models/{model}/ready"),
                on_dead=self._on_dead_stage,
            ),
            followers={self.public_model: [m for m in supervised if m != self.public_model]},
        ).start()

    def _start_front(self) -> None:
        home = self.model_homes.get(self.public_model)
        if home is None:
            raise ServerError(f"public model {self.public_model!r} is not among the models loaded")
        config = front_config(
            self.settings,
            self.models,
            home,
            self._run_path(),
            self.internal_metrics_port,
            self.stages_ready,
        )
        self.front = Front(config).start()
        self.http_port, self.grpc_port = self.front.http_port, self.front.grpc_port
        self.metrics_port = self.front.metrics_port

    def stages_ready(self) -> bool:
        """The front's readiness gate: tritonserver up and no stage being reloaded."""
        supervisor = self.supervisor
        return self._serving and (supervisor is None or supervisor.ready())

    def _on_dead_stage(self, model: str) -> None:
        # A decoupled request whose stub died is never answered (Triton 2.51): end those
        # streams at the front with an error instead of leaving the clients waiting.
        if model == self.public_model and self.front is not None:
            self.front.abort_inference(f"the {model} stage restarted; the request was lost, retry")

    def reload_model(self, model: str) -> None:
        """Unload then load `model` (a plain load of an unchanged model does nothing in 2.51)."""
        self.repository_action(model, "unload")
        self.repository_action(model, "load")

    def mark_down(self, message: str) -> None:
        """tritonserver died: the front answers 503 (Retry-After) and ends the calls in flight."""
        self._serving = False
        if self.front is not None:
            self.front.abort_inference(message)

    def restart(self) -> None:
        """Start tritonserver again after it died, with the same sockets, ports and front.

        The front keeps listening and answers 503 meanwhile (`stages_ready`); the estimator comes
        back from its last snapshot (saved at every refit). ServerError if it does not come up.
        """
        if self.run_dir is None:
            raise ServerError("server not started")
        self.mark_down("tritonserver is restarting; retry shortly")
        if self.supervisor is not None:
            self.supervisor.stop()
            self.supervisor = None
        process, self.process = self.process, None
        if process is not None:
            kill_group(process.pid)
            process.wait()
            # a private /dev/shm vanished with it; in the host's, its regions are removed here
            remove_regions(shm_prefix(os.getpid()))
        for sock in (self.http_socket, self.grpc_socket):
            sock.unlink(missing_ok=True)
        self._launch()
        self.wait_ready()
        if self.front is not None:
            self.front.reconnect_upstream()
        self._start_supervisor()
        self._serving = True

    def wait_ready(self) -> None:
        """Poll until the server and every model answer ready; raise ServerError otherwise."""
        timeout_s = self.settings.server.ready_timeout_s
        deadline = time.monotonic() + timeout_s
        pending = ["/v2/health/ready"] + [f"/v2/models/{m}/ready" for m in self.models]
        while pending:
            code = self.process.poll() if self.process is not None else -1
            if code is not None:
                raise ServerError(
                    f"tritonserver exited with code {code} before it was ready "
                    "(its log says which model failed and why)"
                )
            if time.monotonic() > deadline:
                raise ServerError(
                    f"tritonserver not ready after {timeout_s:.0f} s "
                    f"(still waiting for {pending[0]})"
                )
            if self.triton_api.ok(pending[0]):
                pending.pop(0)
            else:
                time.sleep(0.25)

    def repository_action(self, model: str, action: str) -> None:
        """POST `load` or `unload` for `model` to the repository API; ServerError on failure."""
        try:
            self.triton_api.repository_action(model, action, self.settings.server.ready_timeout_s)
        except TritonAPIError as err:
            raise ServerError(str(err)) from None

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL to its process group); return its exit code.

        Always ends with SIGKILL to the whole process group (the stubs too), even when the
        graceful wait is cut short; SIGINT/SIGTERM are held meanwhile (avspec.serving.
        process_group: the first is noted, the next kills the group at once).
        """
        process: subprocess.Popen | None = None
        code = None

        def kill_now() -> None:
            if process is not None:
                kill_group(process.pid)

        with signals_held(kill_now):
            try:
                # taken first thing in the try: whatever fails below, `finally` kills its group
                # (a signal raising before the try leaves self.process set, for the next stop())
                process, self.process = self.process, None
                for part in (self.front, self.supervisor):
                    if part is not None:
                        part.stop()
                self.front = self.supervisor = None
                if process is not None:
                    code = terminate(process, self.settings.server.exit_timeout_s + 10)
            finally:
                if process is not None:
                    kill_group(process.pid)
                    if code is None:
                        code = process.wait()
                if self.run_dir is not None:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                    self.run_dir = None
                self._serving = False
        return code

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
