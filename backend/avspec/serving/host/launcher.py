"""Command line: serve model repositories with tritonserver behind the front until a signal.

`python -m avspec.serving.host.launcher --model-repository model_repository` serves the CPU
deployment with the tritonserver bundled in nvidia-pytriton (`make serve`). The GPU container
(docker/serve_gpu.sh) runs the same command with its installed tritonserver, backend directory,
two repositories, `--model-config-name gpu` and the models to load, so both deployments get the
same exposure (avspec.serving.host.server_process, avspec.serving.exposure). It prints one line when
every model is ready; the first SIGINT/SIGTERM stops the server gracefully. A tritonserver that
dies is started again (avspec.serving.host.restart: backoff, at most --max-restarts per
--restart-window-s) while the front answers 503 with Retry-After.

Started as root, the launcher reads the admin key, gives the server's user (`--user`, default
uid/gid 10001) its snapshot directories, and executes itself again inside the sandbox as that
user (avspec.serving.host.sandbox): the front, tritonserver and every stub run unprivileged, with a
private /dev/shm. The key crosses the exec through an inherited pipe, never argv or environ.

`--draft-model DIR --target-model DIR` (`make serve DRAFT_MODEL=... TARGET_MODEL=...`) serve a
user's pair: before tritonserver starts, the pair is checked from configs and tokenizers only
(avspec.serving.host.model_pair; a mismatch exits 1 with the pair check's message), one line per
model is printed (path, architecture, dtype, parameters, KV cache reserved), and a copy of the
repository with the pair's overrides (model_dir, vocab_limit, capped max_length / max_context,
the verifier's pair_id) is served from a temporary directory. Either model may be a llama.cpp
`.gguf` file instead (Llama-family only): it is converted once into a Hugging Face directory
(bfloat16) cached under `--gguf-cache` by the file's sha256 (avspec.serving.host.gguf_models), in
the process that parses the arguments, before root is dropped; the pair check, the sandbox and
the re-executed launcher see only the converted directory. A file that is missing or that does
not convert exits 1 with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from avspec.serving.exposure import (
    ADMIN_KEY_ENV,
    ADMIN_KEY_HEADER,
    API_KEYS_ENV,
    read_admin_key,
    read_api_keys,
)
from avspec.serving.front.config import Access
from avspec.serving.host.gguf_models import model_directory
from avspec.serving.host.host_costs import (
    CACHE_ENV,
    CostOptions,
    cache_directory,
    resolve_host_costs,
)
from avspec.serving.host.model_pair import (
    VERIFIER,
    check_target_gguf,
    prepare_pair,
    resolve_auto_engine,
    shared_pool_overrides,
)
from avspec.serving.host.restart import RestartBudget
from avspec.serving.host.sandbox import (
    DEFAULT_SERVER_USER,
    SANDBOXED_ENV,
    ServerUser,
    sandbox_command,
    server_user,
)
from avspec.serving.host.served_models import locate_models, repository_models
from avspec.serving.host.server_files import grant_writable, sandbox_paths, server_files
from avspec.serving.host.server_process import ServerError, ServerProcess
from avspec.serving.repository import ENGINES, SERVING_DTYPES, copy_repository

ADMIN_KEY_FD_ENV = "AVSPEC_ADMIN_KEY_FD"  # the pipe holding the keys across the sandbox's exec
ALLOWED_HOSTS_ENV = "AVSPEC_ALLOWED_HOSTS"
DEFAULT_GGUF_CACHE = Path("build/gguf-cache")  # the cache avspec.tools.setup.fetch_target uses


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse the launcher's command line."""
    parser = argparse.ArgumentParser(
        prog="python -m avspec.serving.host.launcher",
        description="Serve model repositories with tritonserver (by default the one bundled in "
        "nvidia-pytriton) behind the front. Prints one line when every model is ready; "
        "SIGINT/SIGTERM stop it cleanly.",
    )
    parser.add_argument(
        "--model-repository",
        required=True,
        type=Path,
        action="append",
        help="a model repository; repeat to serve several together (a model name may appear "
        "in only one)",
    )
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
        "--api-key-file",
        type=Path,
        help=f"file of API keys, one a line ('NAME KEY' or 'KEY'; or set {API_KEYS_ENV}, "
        "comma-separated): inference then needs 'Authorization: Bearer KEY' (401 otherwise) "
        "and each key is its own client for fairness; without keys the client is its address",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=os.environ.get(ALLOWED_HOSTS_ENV, ""),
        help="comma-separated Host names the HTTP port answers besides IP addresses and "
        "localhost (e.g. the name a proxy or DNS gives it); '*' answers any (no DNS-rebinding "
        f"guard); default {ALLOWED_HOSTS_ENV}",
    )
    parser.add_argument(
        "--completions-special-tokens",
        action="store_true",
        help="let /v1/completions prompts spell special tokens (by default a prompt is text, "
        "as chat message contents always are)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=1 << 20,
        help="largest HTTP request body / gRPC message accepted (413 / RESOURCE_EXHAUSTED past it)",
    )
    parser.add_argument(
        "--draft-model",
        type=Path,
        help="the draft's model: a directory (a Hugging Face checkpoint, the only format the "
        "runtime serves) or a Llama-family .gguf file, converted once into one under "
        "--gguf-cache; it overrides the draft model's model_dir. With either of --draft-model "
        "and --target-model the pair is checked and described before tritonserver starts, and "
        "a rewritten copy of the repository is served",
    )
    parser.add_argument(
        "--target-model",
        type=Path,
        help="the target's model: a directory or a .gguf file (see --draft-model)",
    )
    # any device's dtypes: the stage checks the one it is given against its own device
    dtypes = sorted({name for names in SERVING_DTYPES.values() for name in names})
    for stage in ("target", "draft"):
        parser.add_argument(
            f"--{stage}-dtype",
            choices=dtypes,
            help=f"the {stage} stage's serving precision (its `dtype` parameter; default: the "
            "repository's, auto): float32, bfloat16, auto; on the CPU weight-only int8 / int4 "
            "or w8a8 (int8 weights and activations), on a GPU float16 "
            "(avspec.runtime.precision)",
        )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        help="both stages' runtime (their `engine` parameter; default: the repository's, auto): "
        "torch (the Hugging Face checkpoint in --*-dtype), llamacpp (llama.cpp's ggml on the "
        "CPU, serving each model directory's model.gguf as it is quantized; `make llamacpp`) "
        "or auto (torch where the CPU has native bfloat16, else llamacpp; printed at start)",
    )
    parser.add_argument(
        "--target-gguf",
        help="llama.cpp's engine: the target's GGUF file in its model directory (default "
        "model.gguf, the file as published; model.Q4_0.gguf after make models QUANT=Q4_0)",
    )
    parser.add_argument(
        "--engine-threads",
        type=int,
        help="threads of each llama.cpp stage (their `threads` parameter; default: the "
        "repository's, 0 = every core)",
    )
    parser.add_argument(
        "--gguf-cache",
        type=Path,
        default=DEFAULT_GGUF_CACHE,
        help="where .gguf models are converted, by the file's sha256 (default: %(default)s, "
        "relative to the working directory, shared with avspec.tools.setup.fetch_target)",
    )
    parser.add_argument(
        "--user",
        help=f"started as root: the user everything runs as once the launcher has dropped "
        f"root (NAME, UID or UID:GID; default {DEFAULT_SERVER_USER}; 'root' keeps root, not "
        f"advised); started as another user, that user",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restarts of a dead tritonserver allowed within --restart-window-s (0: exit)",
    )
    parser.add_argument("--restart-window-s", type=float, default=600.0)
    _add_server_choice(parser)
    _add_cost_options(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to execute again as given
    return args


def _add_server_choice(parser: argparse.ArgumentParser) -> None:
    """Options choosing the server and what it loads (the GPU container sets them all)."""
    parser.add_argument(
        "--tritonserver",
        help="tritonserver executable, a path or a name on PATH (default: the one bundled in "
        "nvidia-pytriton, run with the wheel's library and module paths; another one runs in "
        "this environment as is, but for --cpu-threads)",
    )
    parser.add_argument(
        "--backend-directory",
        type=Path,
        help="Triton backend directory, used as is (default: assembled from the wheel for its "
        "server, tritonserver's own default otherwise)",
    )
    parser.add_argument(
        "--model-config-name",
        help="load <model>/configs/NAME.pbtxt where it exists, config.pbtxt otherwise",
    )
    parser.add_argument(
        "--load-model",
        dest="load_models",
        action="append",
        metavar="MODEL",
        help="a model to load; repeat for each (default: every model of the repositories)",
    )


def _add_cost_options(parser: argparse.ArgumentParser) -> None:
    """Options on the verifier's cost tables (avspec.serving.host.host_costs)."""
    parser.add_argument(
        "--cost-tables",
        type=Path,
        help="the verifier's cost tables, a step-cost file (client/profile_costs.py); default: "
        "this host's, measured at first start and cached (needs --draft-model/--target-model)",
    )
    parser.add_argument(
        "--cost-cache",
        type=Path,
        help=f"where this host's cost tables are cached (default ${CACHE_ENV}, else "
        "~/.cache/avspec/costs; started as root /var/cache/avspec/costs)",
    )
    parser.add_argument(
        "--remeasure-costs",
        action="store_true",
        help="measure this host's cost tables again even when cached (make costs)",
    )
    parser.add_argument(
        "--costs-only",
        action="store_true",
        help="resolve (measure when needed) the cost tables, print where they are, and exit",
    )


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
    Run as the process's command (`argv` None) by root, the launcher executes itself again in
    the sandbox (`_reexec_sandboxed`); called with `argv` from Python it keeps its process, and
    only tritonserver and its stubs are sandboxed (ServerProcess).
    """
    args = parse_args(argv)
    args.reexec = argv is None
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


def prepare_repository(
    repository: Path,
    draft_model: Path | None,
    target_model: Path | None,
    workdir: Path,
    settings: dict[str, dict[str, str]] | None = None,
    costs: CostOptions | None = None,
) -> Path:
    """Check the pair (`avspec.serving.host.model_pair.prepare_pair`) when one is given, print its
    lines and return a copy of `repository` under `workdir` with the pair's overrides and the
    stages' `settings` ({"target": {"dtype": "w8a8", "engine": "torch"}, ...}), the verifier's
    cost tables of this host resolved with `costs` (avspec.serving.host.host_costs; measured first
    when not cached). Raises PairError (a ValueError, the pair check's one message) before
    anything is copied or loaded."""
    overrides: dict[str, dict[str, object]] = {}
    if draft_model is not None or target_model is not None:
        pair = prepare_pair(
            repository,
            draft_model.resolve() if draft_model is not None else None,
            target_model.resolve() if target_model is not None else None,
        )
        for line in pair.lines:
            print(line, flush=True)
        overrides = {stage: dict(values) for stage, values in pair.overrides.items()}
    for stage, values in (settings or {}).items():
        for name, value in values.items():
            overrides.setdefault(stage, {})[name] = value
            print(f"avspec: {stage} stage {name} {value}", flush=True)
    if draft_model is not None or target_model is not None:
        for line in [*resolve_auto_engine(repository, pair, overrides),
                     *shared_pool_overrides(repository, pair, overrides)]:  # fmt: skip
            print(line, flush=True)
        check_target_gguf(repository, overrides)
        for line in resolve_host_costs(repository, pair, overrides, costs or CostOptions()):
            print(line, flush=True)
    return copy_repository(repository, workdir / repository.name, overrides)


def _stage_settings(args: argparse.Namespace) -> dict[str, dict[str, str]]:
    """The --target-dtype / --draft-dtype / --engine / --target-gguf / --cost-tables given,
    by model."""
    given = {"target": args.target_dtype, "draft": args.draft_dtype}
    settings = {stage: {"dtype": dtype} for stage, dtype in given.items() if dtype is not None}
    for name, value in (("engine", args.engine), ("threads", args.engine_threads)):
        if value is not None:
            for stage in given:
                settings.setdefault(stage, {})[name] = str(value)
    if args.target_gguf is not None:
        settings.setdefault("target", {})["gguf"] = args.target_gguf
    if args.cost_tables is not None:
        settings[VERIFIER] = {"cost_tables": str(args.cost_tables.resolve())}
    return settings


def _serve(args: argparse.Namespace) -> int:
    try:
        secrets = _secrets(args)
        user = server_user(args.user) if not os.environ.get(SANDBOXED_ENV) else None
        convert_gguf_models(args)
        if user is not None and args.reexec:
            _reexec_sandboxed(args, user, secrets)  # returns only on failure
        elif user is None and os.geteuid() == 0 and not os.environ.get(SANDBOXED_ENV):
            print("avspec: --user root: tritonserver and its stubs run as root", flush=True)
    except (ValueError, OSError, ServerError) as err:
        print(f"avspec: {err}", file=sys.stderr, flush=True)
        return 1
    with tempfile.TemporaryDirectory(prefix="avspec-repository-") as workdir:
        return _serve_in(args, Path(workdir), secrets)


def convert_gguf_models(args: argparse.Namespace) -> None:
    """Replace a --draft-model / --target-model that names a .gguf file by its converted
    directory (avspec.serving.host.gguf_models), in `args` and in the arguments a re-execution
    gets (`args.argv`: the directory is appended, and argparse keeps an option's last value).
    Raises GGUFError (a ValueError) naming the file for one that cannot be converted."""
    for option, dest in (("--draft-model", "draft_model"), ("--target-model", "target_model")):
        given = getattr(args, dest)
        if given is None:
            continue
        directory = model_directory(given, args.gguf_cache, option)
        if directory != given:
            setattr(args, dest, directory)
            args.argv = [*args.argv, option, str(directory)]


@dataclass(frozen=True)
class Secrets:
    """The operator's admin key and the API keys, read once (as root, before the sandbox)."""

    admin_key: str | None = None
    api_keys: tuple[tuple[str, str], ...] = ()


def _secrets(args: argparse.Namespace) -> Secrets:
    """The keys: from the sandbox's pipe, else --admin-key-file / AVSPEC_ADMIN_KEY and
    --api-key-file / AVSPEC_API_KEYS.

    They stay in this process's memory only: the variables are removed from the environment
    (no child inherits them), and the pipe is read to its end and closed.
    """
    fd = os.environ.pop(ADMIN_KEY_FD_ENV, None)
    if fd is not None:
        with os.fdopen(int(fd), "r") as pipe:
            given = json.loads(pipe.read())
        admin = given["admin_key"]
        return Secrets(
            read_admin_key(None, {ADMIN_KEY_ENV: admin}) if admin else None,
            tuple((name, key) for name, key in given["api_keys"]),
        )
    secrets = Secrets(read_admin_key(args.admin_key_file), read_api_keys(args.api_key_file))
    os.environ.pop(ADMIN_KEY_ENV, None)
    os.environ.pop(API_KEYS_ENV, None)
    return secrets


def _pipe_secrets(secrets: Secrets) -> int:
    """An inheritable pipe's read end holding `secrets` (read back by `_secrets`)."""
    read_end, write_end = os.pipe()
    given = {"admin_key": secrets.admin_key, "api_keys": [list(k) for k in secrets.api_keys]}
    os.write(write_end, json.dumps(given).encode())  # within a pipe's buffer (64 KiB)
    os.close(write_end)
    os.set_inheritable(read_end, True)
    return read_end


def _reexec_sandboxed(args: argparse.Namespace, user: ServerUser, secrets: Secrets) -> None:
    """Started as root: give `user` its snapshot directories, then execute this launcher again
    inside the sandbox as `user`, with the same arguments and the key in an inherited pipe.

    The snapshot paths of a repository copy (`prepare_repository`) are the original's, made
    absolute against the same root, so granting the originals' is enough.
    """
    repositories = [Path(r).resolve() for r in args.model_repository]
    models = [m for r in repositories for m in repository_models(r)]
    files = server_files(repositories, locate_models(repositories, models), args.model_config_name)
    costs = cache_directory(args.cost_cache)  # this host's cost tables, written by `user`
    writable = [*files.writable, costs]
    grant_writable(writable, user)
    given = (args.draft_model, args.target_model, args.tritonserver, args.backend_directory,
             args.cost_tables)  # fmt: skip
    expose = sandbox_paths(files, Path.cwd(), *(Path(p).resolve() for p in given if p))
    if secrets != Secrets():
        os.environ[ADMIN_KEY_FD_ENV] = str(_pipe_secrets(secrets))
    launcher = [sys.executable, "-m", "avspec.serving.host.launcher", *args.argv]
    print(f"avspec: dropping root: the server runs as uid {user.uid}, gid {user.gid}", flush=True)
    launcher += ["--cost-cache", str(costs)]
    command = sandbox_command(launcher, user, expose, writable)
    os.execv(command[0], command)


def _serve_in(args: argparse.Namespace, workdir: Path, secrets: Secrets) -> int:
    server = None
    try:
        repositories = list(args.model_repository)
        settings = _stage_settings(args)
        if args.draft_model is not None or args.target_model is not None or settings:
            costs = CostOptions(args.cpu_threads, args.cost_cache, args.remeasure_costs)
            repositories[0] = prepare_repository(
                repositories[0], args.draft_model, args.target_model, workdir, settings, costs
            )
        if args.costs_only:
            if args.draft_model is None and args.target_model is None:
                raise ValueError("--costs-only needs --draft-model and --target-model")
            return 0
        server = ServerProcess(
            repositories[0],
            args.http_port,
            args.grpc_port,
            args.metrics_port,
            log_verbose=args.log_verbose,
            exit_timeout_s=args.exit_timeout_secs,
            ready_timeout_s=args.ready_timeout_secs,
            cpu_threads=args.cpu_threads or None,
            host=args.host,
            admin_key=secrets.admin_key,
            access=Access(
                api_keys=secrets.api_keys,
                allowed_hosts=tuple(h.strip() for h in args.allowed_hosts.split(",") if h.strip()),
                completions_special_tokens=args.completions_special_tokens,
            ),
            max_body_bytes=args.max_body_bytes,
            tritonserver=args.tritonserver,
            backend_directory=args.backend_directory,
            extra_repositories=repositories[1:],
            model_config_name=args.model_config_name,
            load_models=args.load_models,
            user=args.user,
        )
        server.start()
        admin = "open with the operator's key" if server.admin_key else "closed"
        keys = len(secrets.api_keys)
        if keys:
            print(f"avspec: inference needs an API key ({keys} configured)", flush=True)
        print(
            f"avspec: serving {len(server.models)} models on {server.host}, "
            f"HTTP :{server.http_port} gRPC :{server.grpc_port} metrics :{server.metrics_port} "
            f"(public: inference on {server.public_model!r}, health, metrics; admin API "
            f"{admin})",
            flush=True,
        )
        code = _keep_serving(server, RestartBudget(args.max_restarts, args.restart_window_s))
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


def _keep_serving(server: ServerProcess, budget: RestartBudget) -> int | None:
    """Watch tritonserver; start it again when it dies, until the restart budget is spent.

    Returns the exit code of the death that exhausted the budget. The front stays up throughout
    and answers 503 with Retry-After while tritonserver is down.
    """
    while True:
        while (code := server.process.poll()) is None:
            time.sleep(0.5)
        server.mark_down(f"tritonserver exited with code {code}; restarting, retry shortly")
        while True:
            delay = budget.next_delay(time.monotonic())
            if delay is None:
                print(
                    f"avspec: tritonserver exited with code {code}; {budget.max_restarts} "
                    f"restarts within {budget.window_s:.0f} s already: giving up",
                    file=sys.stderr,
                    flush=True,
                )
                return code
            print(
                f"avspec: tritonserver exited with code {code}; restarting in {delay:.0f} s "
                f"(restart {budget.used} of {budget.max_restarts} in {budget.window_s:.0f} s)",
                file=sys.stderr,
                flush=True,
            )
            time.sleep(delay)
            try:
                server.restart()
            except ServerError as err:
                print(f"avspec: restart failed: {err}", file=sys.stderr, flush=True)
                code = server.process.poll() if server.process is not None else code
                continue
            print("avspec: tritonserver restarted; serving again", flush=True)
            break


if __name__ == "__main__":
    sys.exit(main())
