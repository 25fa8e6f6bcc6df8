"""Start the Triton Inference Server bundled in the nvidia-pytriton wheel on a model repository.

The wheel carries a complete tritonserver, the Python backend and one backend stub per Python
version (see shared/design/triton.md). Starting it takes: a backend directory holding `python/`
with `libtriton_python.so`, `triton_python_backend_utils.py` and the stub matching this
interpreter; LD_LIBRARY_PATH with this interpreter's libpython and the wheel's bundled libraries;
PYTHONPATH so the stub processes import this environment's packages and `avspec`.

Models are loaded in explicit control mode (`--load-model=*`), so clients may unload and reload
single models through the repository API (the serving tests do this to prove warm start).

Command line: `python -m avspec.serving.launcher --model-repository model_repository`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
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


class ServerProcess:
    """A running tritonserver on a model repository; use as a context manager.

    `start()` returns once every model of the repository is ready, or raises ServerError
    (server exited, or not ready within `ready_timeout_s`). `stop()` sends SIGTERM, then
    SIGKILL to the whole process group after `exit_timeout_s` + 10 s.
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
        self.process: subprocess.Popen | None = None
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

    def command(self, backend_directory: Path) -> list[str]:
        """Return the tritonserver command line."""
        return [
            str(tritonserver_binary()),
            f"--model-repository={self.model_repository}",
            f"--backend-directory={backend_directory}",
            "--model-control-mode=explicit",
            "--load-model=*",
            "--disable-auto-complete-config",  # config.pbtxt is complete; saves a stub per model
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            "--allow-metrics=true",
            f"--metrics-port={self.metrics_port}",
            f"--exit-timeout-secs={self.exit_timeout_s}",
            f"--log-verbose={self.log_verbose}",
        ]

    def start(self) -> ServerProcess:
        """Start the server and wait until every model is ready."""
        if self.process is not None:
            raise ServerError("server already started")
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
        except BaseException:
            self.stop()
            raise
        return self

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
            with urllib.request.urlopen(self.http_url + path, timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return False

    def repository_action(self, model: str, action: str) -> None:
        """POST `load` or `unload` for `model` to the repository API; ServerError on failure."""
        url = f"{self.http_url}/v2/repository/models/{model}/{action}"
        request = urllib.request.Request(url, data=json.dumps({}).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.ready_timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{action} {model}: {err.code} {err.read().decode()}") from None

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL to its process group); return its exit code."""
        process, self.process = self.process, None
        code = None
        if process is not None:
            code = process.poll()
            if code is None:
                process.send_signal(signal.SIGTERM)
                try:
                    code = process.wait(timeout=self.exit_timeout_s + 10)
                except subprocess.TimeoutExpired:
                    code = None
            self._kill_group(process.pid)
            if code is None:
                code = process.wait()
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None
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
    return parser.parse_args(argv)


class _StopRequested(Exception):
    """Raised in the main thread by the SIGINT/SIGTERM handler."""


def _request_stop(signum: int, frame: object) -> None:
    raise _StopRequested(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGINT/SIGTERM or until it dies; return the exit status."""
    args = parse_args(argv)
    previous = {s: signal.signal(s, _request_stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _serve(args)
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
        )
        server.start()
        print(
            f"avspec: serving {len(server.models)} models, HTTP :{server.http_port} "
            f"gRPC :{server.grpc_port} metrics :{server.metrics_port}",
            flush=True,
        )
        while (code := server.process.poll()) is None:
            time.sleep(0.5)
        print(f"avspec: tritonserver exited unexpectedly with code {code}", file=sys.stderr)
        server.stop()
        return code or 1
    except ServerError as err:
        print(f"avspec: {err}", file=sys.stderr, flush=True)
        return 1
    except _StopRequested as why:
        code = server.stop() if server is not None else None
        print(f"avspec: stopped on {why} (tritonserver exit code {code})", flush=True)
        return 0


if __name__ == "__main__":
    sys.exit(main())
