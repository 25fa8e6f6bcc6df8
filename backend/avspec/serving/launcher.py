"""Start the Triton Inference Server bundled in the nvidia-pytriton wheel on a model repository.

The wheel carries a complete tritonserver, the Python backend and one backend stub per Python
version (see shared/design/triton.md). Starting it takes: a backend directory holding `python/`
with `libtriton_python.so`, `triton_python_backend_utils.py` and the stub matching this
interpreter; LD_LIBRARY_PATH with this interpreter's libpython and the wheel's bundled libraries;
PYTHONPATH so the stub processes import this environment's packages and `avspec`.

Safe by default (avspec.serving.exposure): tritonserver listens on 127.0.0.1 behind the front
(avspec.serving.front), which alone holds the public HTTP and gRPC ports and routes inference on
`speculative`, health and metadata; model control and the other admin APIs need the operator's
admin key. A supervisor (avspec.serving.supervisor) reloads a model whose stub died. Models are
loaded in explicit control mode (`--load-model=*`), so an operator with the key may unload and
reload single models (the serving tests do this to prove warm start).

Command line: `python -m avspec.serving.launcher --model-repository model_repository`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

import avspec
from avspec.serving.cleanup import clean_leftovers, shm_prefix
from avspec.serving.exposure import ADMIN_KEY_ENV, ADMIN_KEY_HEADER, Keys, read_admin_key
from avspec.serving.front import Front, FrontConfig, generate_schema_from_config
from avspec.serving.supervisor import StageSupervisor

BACKEND_SOURCE_DIR = Path(avspec.__file__).resolve().parent.parent  # the `backend/` directory


class ServerError(RuntimeError):
    """The server could not be started, died, or never became ready."""


def pytriton_root() -> Path:
    """Return the installed `pytriton` package directory (holding `tritonserver/`)."""
    import pytriton  # imported here: only the launcher needs the wheel

    return Path(pytriton.__file__).resolve().parent


def tritonserver_binary() -> Path:
    """Return the path of the bundled `tritonserver` executable."""
    binary = pytriton_root() / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise ServerError(f"tritonserver not found at {binary}: is nvidia-pytriton installed?")
    return binary


def prepare_backend_directory(target: Path) -> Path:
    """Assemble `<target>/python/` with the Python backend and this interpreter's stub."""
    dist = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise ServerError(f"no Python backend stub for Python {version} at {stub}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (
        dist / "backends" / "python" / "libtriton_python.so",
        dist / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        shutil.copy2(source, python_dir / source.name)
    return target


def server_environment(
    base: dict[str, str] | None = None, cpu_threads: int | None = 1
) -> dict[str, str]:
    """Return the environment for tritonserver and its Python stub processes.

    cpu_threads sets OMP_NUM_THREADS for every stub process (None: leave as is). Each model
    instance is its own process; with torch's default of one spinning thread per core in each,
    the stages fight over the cores (measured on 2 cores: a 20-token request 9 s vs 0.8 s).
    """
    env = dict(os.environ if base is None else base)
    if cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    libs = [
        sysconfig.get_config_var("LIBDIR"),
        str(pytriton_root().parent / "nvidia_pytriton.libs"),
    ]
    paths = [str(BACKEND_SOURCE_DIR), sysconfig.get_paths()["purelib"]]
    # The stub's embedded interpreter finds its prefix (and this venv's site-packages, with the
    # editable install of avspec) from the first `python3` on PATH, as PyTriton's launcher does.
    bindir = [str(Path(sys.executable).parent)]
    for key, extra in (("LD_LIBRARY_PATH", libs), ("PYTHONPATH", paths), ("PATH", bindir)):
        existing = [p for p in env.get(key, "").split(os.pathsep) if p]
        env[key] = os.pathsep.join(extra + existing)
    return env


def repository_models(repository: Path) -> list[str]:
    """Return the names of the models (directories with a config.pbtxt) in `repository`."""
    return sorted(p.parent.name for p in repository.glob("*/config.pbtxt"))


def python_models(repository: Path) -> list[str]:
    """The models of `repository` run by the Python backend (one stub process per instance)."""
    return sorted(
        p.parent.name
        for p in repository.glob("*/config.pbtxt")
        if re.search(r'^\s*backend:\s*"python"', p.read_text(), re.MULTILINE)
    )


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on `host` a moment ago."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A running tritonserver on a model repository; use as a context manager.

    `start()` returns once every model of the repository is ready and the front listens, or
    raises ServerError (server exited, or not ready within `ready_timeout_s`). `stop()` sends
    SIGTERM, then SIGKILL to the whole process group after `exit_timeout_s` + 10 s.

    http_port and grpc_port are the front's public ports on `host`; tritonserver's own HTTP and
    gRPC ports are free loopback ports (`internal_http_url`). `admin_key`: the operator's key
    for the admin APIs (None: closed to clients). `public_model`: the one model clients may
    run; its config.pbtxt gives the front the generate body's schema.
    """

    def __init__(
        self,
        model_repository: str | Path,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        log_verbose: int = 0,
        exit_timeout_s: int = 10,
        ready_timeout_s: float = 300.0,
        log_path: str | Path | None = None,
        cpu_threads: int | None = 1,
        *,
        host: str = "127.0.0.1",
        admin_key: str | None = None,
        max_body_bytes: int = 1 << 20,
        public_model: str = "speculative",
        supervise: bool = True,
    ) -> None:
        self.model_repository = Path(model_repository).resolve()
        if not self.model_repository.is_dir():
            raise ServerError(f"model repository {self.model_repository} is not a directory")
        self.models = repository_models(self.model_repository)
        if not self.models:
            raise ServerError(f"no model (*/config.pbtxt) in {self.model_repository}")
        self.http_port, self.grpc_port, self.metrics_port = http_port, grpc_port, metrics_port
        self.log_verbose = log_verbose
        self.exit_timeout_s = exit_timeout_s
        self.ready_timeout_s = ready_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.cpu_threads = cpu_threads
        self.host = host
        self.keys = Keys(operator_admin_key=admin_key)
        self.max_body_bytes = max_body_bytes
        self.public_model = public_model
        self.supervise = supervise
        self.internal_http_port = self.internal_grpc_port = 0
        self.process: subprocess.Popen | None = None
        self.front: Front | None = None
        self.supervisor: StageSupervisor | None = None
        self._workdir: tempfile.TemporaryDirectory | None = None

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
    def internal_http_url(self) -> str:
        """tritonserver's own HTTP endpoint (loopback; inference and admin need keys)."""
        return f"http://127.0.0.1:{self.internal_http_port}"

    def command(self, backend_directory: Path) -> list[str]:
        """Return the tritonserver command line."""
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_directory}",
            "--model-control-mode=explicit",
            "--load-model=*",
            "--disable-auto-complete-config",  # config.pbtxt is complete; saves a stub per model
            "--http-address=127.0.0.1",
            f"--http-port={self.internal_http_port}",
            "--grpc-address=127.0.0.1",
            f"--grpc-port={self.internal_grpc_port}",
            *self.keys.triton_flags(),
            "--allow-metrics=true",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            # regions named after this launcher, so the next start can tell its leftovers
            f"--backend-config=python,shm-region-prefix-name={shm_prefix(os.getpid())}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]

    def start(self) -> ServerProcess:
        """Start the server and wait until every model is ready."""
        if self.process is not None:
            raise ServerError("server already started")
        clean_leftovers()
        self.internal_http_port, self.internal_grpc_port = free_port(), free_port()
        self._workdir = tempfile.TemporaryDirectory(prefix="avspec-triton-")
        backends = prepare_backend_directory(Path(self._workdir.name) / "backends")
        out = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
        self.process = subprocess.Popen(
            self.command(backends),
            env=server_environment(cpu_threads=self.cpu_threads),
            stdout=out,
            stderr=subprocess.STDOUT if out is not None else None,
            start_new_session=True,  # own process group: stop() reaches the stub processes
        )
        if out is not None:
            out.close()
        try:
            self.wait_ready()
            self._start_supervisor()
            self._start_front()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_supervisor(self) -> None:
        if not self.supervise:
            return
        self.supervisor = StageSupervisor(
            self.process.pid,
            self.model_repository,
            python_models(self.model_repository),
            reload=self.reload_model,
            is_loaded=lambda model: self._http_ok(f"/v2/models/{model}/ready"),
            on_dead=self._on_dead_stage,
        ).start()

    def _start_front(self) -> None:
        config_file = self.model_repository / self.public_model / "config.pbtxt"
        if not config_file.is_file():
            raise ServerError(f"public model {self.public_model!r} has no {config_file}")
        self.front = Front(
            FrontConfig(
                host=self.host,
                http_port=self.http_port,
                grpc_port=self.grpc_port,
                upstream_http=f"127.0.0.1:{self.internal_http_port}",
                upstream_grpc=f"127.0.0.1:{self.internal_grpc_port}",
                front_key=self.keys.front_key,
                admin_key=self.keys.operator_admin_key,
                public_models=(self.public_model,),
                generate_schema=generate_schema_from_config(config_file.read_text()),
                max_body_bytes=self.max_body_bytes,
                ready=self.supervisor.ready if self.supervisor is not None else None,
            )
        ).start()
        self.http_port, self.grpc_port = self.front.http_port, self.front.grpc_port

    def _on_dead_stage(self, model: str) -> None:
        # A decoupled request whose stub died is never answered (Triton 2.51): end those
        # streams at the front with an error instead of leaving the clients waiting.
        if model == self.public_model and self.front is not None:
            self.front.abort_inference(f"the {model} stage restarted; the request was lost, retry")

    def reload_model(self, model: str) -> None:
        """Unload then load `model` (a plain load of an unchanged model does nothing in 2.51)."""
        self.repository_action(model, "unload")
        self.repository_action(model, "load")

    def wait_ready(self) -> None:
        """Poll until the server and every model answer ready; raise ServerError otherwise."""
        deadline = time.monotonic() + self.ready_timeout_s
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
                    f"tritonserver not ready after {self.ready_timeout_s:.0f} s "
                    f"(still waiting for {pending[0]})"
                )
            if self._http_ok(pending[0]):
                pending.pop(0)
            else:
                time.sleep(0.25)

    def _http_ok(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.internal_http_url + path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def repository_action(self, model: str, action: str) -> None:
        """POST `load` or `unload` for `model` to the repository API; ServerError on failure."""
        url = f"{self.internal_http_url}/v2/repository/models/{model}/{action}"
        request = urllib.request.Request(
            url,
            data=json.dumps({}).encode(),
            headers={ADMIN_KEY_HEADER: self.keys.admin_key},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.ready_timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{action} {model}: {err.code} {err.read().decode()}") from None

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL to its process group); return its exit code.

        Always ends with SIGKILL to the whole process group (the stubs too), even when the
        graceful wait is cut short. Called in the main thread, it holds SIGINT/SIGTERM for its
        duration: the first is noted, the next kills the group at once (ending the wait). A
        handler that raised here would abandon the stop half-way, leaving the server serving.
        """
        process: subprocess.Popen | None = None
        code = None
        noted: list[str] = []

        def say(text: str) -> None:
            # os.write, not print: a handler may run in the middle of a print to stderr
            with contextlib.suppress(OSError):
                os.write(2, f"avspec: {text}\n".encode())

        def note(signum: int, frame: object) -> None:
            noted.append(signal.Signals(signum).name)
            if len(noted) == 1:
                say(f"{noted[-1]} while stopping: noted; one more kills the server at once")
            elif process is not None:
                say(f"{noted[-1]} while stopping: killing the server's process group")
                self._kill_group(process.pid)

        previous = {}
        with contextlib.suppress(ValueError):  # not the main thread: no handler runs here anyway
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.signal(signum, note)
        try:
            # taken first thing in the try: whatever fails below, `finally` kills its group (a
            # signal raising before the try leaves self.process set, for the next stop())
            process, self.process = self.process, None
            for part in (self.front, self.supervisor):
                if part is not None:
                    part.stop()
            self.front = self.supervisor = None
            if process is not None:
                code = process.poll()
                if code is None:
                    process.send_signal(signal.SIGTERM)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        code = process.wait(timeout=self.exit_timeout_s + 10)
        finally:
            if process is not None:
                self._kill_group(process.pid)
                if code is None:
                    code = process.wait()
            if self._workdir is not None:
                self._workdir.cleanup()
                self._workdir = None
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return code

    @staticmethod
    def _kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.serving.launcher",
        description="Serve a model repository with the Triton server bundled in nvidia-pytriton. "
        "Prints one line when every model is ready; SIGINT/SIGTERM stop it cleanly.",
    )
    parser.add_argument("--model-repository", required=True, type=Path)
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver verbosity")
    parser.add_argument("--exit-timeout-secs", type=int, default=10)
    parser.add_argument("--ready-timeout-secs", type=float, default=300.0)
    parser.add_argument(
        "--cpu-threads",
        type=int,
        default=1,
        help="torch CPU threads per model instance (OMP_NUM_THREADS); 0 leaves it unset",
    )
    parser.add_argument(
        "--host",
        default="0.0.0.0",
        help="address of the public HTTP, gRPC and metrics ports (an IP; tritonserver itself "
        "listens on 127.0.0.1 behind the front)",
    )
    parser.add_argument(
        "--admin-key-file",
        type=Path,
        help=f"file whose first line opens the admin APIs to clients sending it in header "
        f"'{ADMIN_KEY_HEADER}' (or set {ADMIN_KEY_ENV}); without either they stay closed",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest HTTP request body / gRPC message accepted (413 / RESOURCE_EXHAUSTED past it)",
    )
    return parser.parse_args(argv)


class _StopRequested(Exception):
    """Raised in the main thread by the first SIGINT/SIGTERM (`_request_stop`), never twice."""


def _request_stop(signum: int, frame: object) -> None:
    """`main`'s SIGINT/SIGTERM handler: disarm, then raise _StopRequested in the main thread.

    Raising is what interrupts a start still waiting for the models. It must happen once: make
    forwards SIGTERM twice, 50 ms apart, and a second raise would land in the stop the first
    one started. So it first swaps itself for a handler that only reports; `ServerProcess.stop`
    holds the signals itself while it runs, and `main` restores the original handlers.
    """

    def already_stopping(late: int, _: object) -> None:
        with contextlib.suppress(OSError):  # os.write: a print may be under way in main
            os.write(2, f"avspec: {signal.Signals(late).name} ignored, stopping\n".encode())

    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, already_stopping)
    raise _StopRequested(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM or until it dies; return the exit status.

    The first SIGINT/SIGTERM stops the server gracefully (status 0); one more during the stop
    is noted, the next kills the server's process group at once (`ServerProcess.stop`).
    """
    args = parse_args(argv)
    previous = {s: signal.signal(s, _request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args)
    except _StopRequested as why:
        # raised inside one of _serve's except clauses: the server is already stopped there
        print(f"avspec: stopped on {why}", flush=True)
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _serve(args: argparse.Namespace) -> int:
    server = None
    try:
        server = ServerProcess(
            args.model_repository,
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            log_verbose=args.log_verbose,
            exit_timeout_s=args.exit_timeout_secs,
            ready_timeout_s=args.ready_timeout_secs,
            cpu_threads=args.cpu_threads or None,
            host=args.host,
            admin_key=read_admin_key(args.admin_key_file),
            max_body_bytes=args.max_body_bytes,
        )
        server.start()
        admin = "open with the operator's key" if server.keys.operator_admin_key else "closed"
        print(
            f"avspec: serving {len(server.models)} models on {server.host}, "
            f"HTTP :{server.http_port} gRPC :{server.grpc_port} metrics :{server.metrics_port} "
            f"(public: inference on {server.public_model!r}, health, metrics; admin API "
            f"{admin})",
            flush=True,
        )
        while (code := server.process.poll()) is None:
            time.sleep(0.5)
        print(f"avspec: tritonserver exited unexpectedly with code {code}", file=sys.stderr)
        server.stop()
        return code or 1
    except (ServerError, ValueError, OSError) as err:
        print(f"avspec: {err}", file=sys.stderr, flush=True)
        if server is not None:
            server.stop()
        return 1
    except _StopRequested as why:
        code = server.stop() if server is not None else None
        print(f"avspec: stopped on {why} (tritonserver exit code {code})", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
