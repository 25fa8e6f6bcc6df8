"""The deployment's settings: one frozen object, built once from the command line and the
environment (`ServeSettings.from_args`), handed to the serve loop and to ServerProcess.

Grouped by what each part of the host needs: `network` (the front's public ports), `server`
(which tritonserver, how it logs, waits and stops), `models` (the repositories and what they
load), `security` (the operator's admin key, the API keys and Host names, the server's user),
`pair` (a user's draft and target, the stages' overrides), `costs` (the verifier's cost tables)
and `restart` (the budget of restarts of a dead tritonserver). The keys never show in a repr.
Built from Python (tests, benchmarks), every group but `models` has the CPU deployment's
defaults: `ServeSettings(ModelSettings((repository,)))`.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from avspec.serving.front.config import Access
from avspec.serving.host.gguf_models import model_directory
from avspec.serving.host.host_costs import CostOptions
from avspec.serving.host.keys import Secrets, read_secrets
from avspec.serving.host.model_pair import VERIFIER
from avspec.serving.host.restart import RestartBudget
from avspec.serving.host.sandbox import SANDBOXED_ENV, server_user

ALLOWED_HOSTS_ENV = "AVSPEC_ALLOWED_HOSTS"
DEFAULT_GGUF_CACHE = Path("build/gguf-cache")  # the cache avspec.tools.setup.fetch_target uses


@dataclass(frozen=True)
class NetworkSettings:
    """The front's public HTTP, gRPC and metrics ports on `host` (0: a free port)."""

    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    host: str = "127.0.0.1"
    max_body_bytes: int = 1 << 20  # largest HTTP body / gRPC message the front accepts


@dataclass(frozen=True)
class TritonSettings:
    """Which tritonserver, and how it runs (avspec.serving.host.triton_env).

    `tritonserver`: a path or a name on PATH (None: the wheel's, run with the wheel's
    environment). `backend_directory`: used as is (None: assembled from the wheel for its
    server, tritonserver's own default otherwise). `cpu_threads`: OMP_NUM_THREADS of every stub
    (None: left as is). `supervise`: reload a model whose stub died.
    """

    tritonserver: str | Path | None = None
    backend_directory: str | Path | None = None
    log_verbose: int = 0
    exit_timeout_s: int = 10
    ready_timeout_s: float = 300.0
    log_path: Path | None = None  # tritonserver's output (None: this process's)
    cpu_threads: int | None = 1
    supervise: bool = True

    def __post_init__(self) -> None:
        if self.log_path is not None:
            object.__setattr__(self, "log_path", Path(self.log_path))


@dataclass(frozen=True)
class ModelSettings:
    """The repositories served together (made absolute), and what they load.

    `load_models`: the models to load (None: every model of the repositories).
    `model_config_name`: `<model>/configs/NAME.pbtxt` where it exists. `public_model`: the one
    model clients may run; its configuration gives the front the generate body's schema.
    """

    repositories: tuple[Path, ...]
    load_models: tuple[str, ...] | None = None
    model_config_name: str | None = None
    public_model: str = "speculative"

    def __post_init__(self) -> None:
        if isinstance(self.repositories, str | Path):
            raise TypeError("repositories is a sequence of paths")
        resolved = tuple(Path(r).resolve() for r in self.repositories)
        object.__setattr__(self, "repositories", resolved)
        if self.load_models is not None:
            object.__setattr__(self, "load_models", tuple(self.load_models))


@dataclass(frozen=True)
class SecuritySettings:
    """Who may use the front, and who the server runs as.

    `admin_key`: the operator's key for the admin APIs (None: closed). `access`: API keys, Host
    names and prompt rules of the front. `user`: who tritonserver runs as when started by root
    ("NAME", "UID[:GID]", None for the sandbox's default user, "root" to stay root).
    """

    admin_key: str | None = field(default=None, repr=False)
    access: Access = field(default_factory=Access, repr=False)
    user: str | None = None

    def secrets(self) -> Secrets:
        """The keys, as they cross the sandbox's exec (avspec.serving.host.keys)."""
        return Secrets(self.admin_key, self.access.api_keys)


@dataclass(frozen=True)
class PairSettings:
    """A user's draft and target (directories; a .gguf given is converted when the settings are
    built) and the stages' overrides (`--target-dtype`, `--engine`, ...; None: the
    repository's)."""

    draft_model: Path | None = None
    target_model: Path | None = None
    target_dtype: str | None = None
    draft_dtype: str | None = None
    engine: str | None = None
    target_gguf: str | None = None
    engine_threads: int | None = None
    gguf_cache: Path = DEFAULT_GGUF_CACHE

    @property
    def given(self) -> bool:
        """Whether a draft or a target was given (the pair is then checked and described)."""
        return self.draft_model is not None or self.target_model is not None


@dataclass(frozen=True)
class CostSettings:
    """The verifier's cost tables (avspec.serving.host.host_costs)."""

    tables: Path | None = None  # a step-cost file (None: this host's, measured and cached)
    cache: Path | None = None
    remeasure: bool = False
    only: bool = False  # resolve the tables, then exit

    def options(self, cpu_threads: int | None) -> CostOptions:
        """What resolving this host's tables needs from the launcher."""
        return CostOptions(cpu_threads, self.cache, self.remeasure)


@dataclass(frozen=True)
class RestartSettings:
    """Restarts of a dead tritonserver allowed within a window (0: exit with it)."""

    max_restarts: int = 5
    window_s: float = 600.0

    def budget(self) -> RestartBudget:
        """A fresh budget of these restarts."""
        return RestartBudget(self.max_restarts, self.window_s)


@dataclass(frozen=True)
class ServeSettings:
    """Everything a deployment is started with (module docstring); `argv` is the command line
    a sandboxed re-execution gets (a converted .gguf's directory appended)."""

    models: ModelSettings
    network: NetworkSettings = NetworkSettings()
    server: TritonSettings = TritonSettings()
    security: SecuritySettings = SecuritySettings()
    pair: PairSettings = PairSettings()
    costs: CostSettings = CostSettings()
    restart: RestartSettings = RestartSettings()
    argv: tuple[str, ...] = ()

    def stage_settings(self) -> dict[str, dict[str, str]]:
        """The stages' overrides given (dtype, engine, threads, gguf, cost_tables), by model."""
        pair = self.pair
        given = {"target": pair.target_dtype, "draft": pair.draft_dtype}
        settings = {stage: {"dtype": dtype} for stage, dtype in given.items() if dtype is not None}
        for name, value in (("engine", pair.engine), ("threads", pair.engine_threads)):
            if value is not None:
                for stage in given:
                    settings.setdefault(stage, {})[name] = str(value)
        if pair.target_gguf is not None:
            settings.setdefault("target", {})["gguf"] = pair.target_gguf
        if self.costs.tables is not None:
            settings[VERIFIER] = {"cost_tables": str(self.costs.tables.resolve())}
        return settings

    def serving(self, repository: Path) -> ServeSettings:
        """These settings with `repository` (a prepared copy) in place of the first one."""
        repositories = (repository, *self.models.repositories[1:])
        return dataclasses.replace(
            self, models=dataclasses.replace(self.models, repositories=repositories)
        )

    @classmethod
    def for_repository(
        cls,
        repository: str | Path,
        ports: Sequence[int] = (8000, 8001, 8002),
        log_path: str | Path | None = None,
    ) -> ServeSettings:
        """The CPU deployment on one repository (tests, benchmarks): the front's HTTP, gRPC and
        metrics `ports` on 127.0.0.1, tritonserver's output in `log_path`."""
        http, grpc, metrics = ports
        log = Path(log_path) if log_path is not None else None
        return cls(
            ModelSettings((Path(repository),)),
            NetworkSettings(http, grpc, metrics),
            TritonSettings(log_path=log),
        )

    @classmethod
    def from_args(
        cls, args: argparse.Namespace, environ: MutableMapping[str, str]
    ) -> ServeSettings:
        """The settings of the launcher's command line (avspec.serving.host.cli).

        In this order: the keys are read (and their variables removed from `environ`,
        avspec.serving.host.keys), `--user` is checked (outside the sandbox), and a .gguf
        model is converted (avspec.serving.host.gguf_models). ValueError (GGUFError, a bad
        key or user) or OSError otherwise.
        """
        secrets = read_secrets(args.admin_key_file, args.api_key_file, environ)
        if not environ.get(SANDBOXED_ENV):
            server_user(args.user)  # a bad --user fails before a long conversion
        pair, argv = _pair(args)
        hosts = args.allowed_hosts
        if hosts is None:
            hosts = environ.get(ALLOWED_HOSTS_ENV, "")
        access = Access(
            api_keys=secrets.api_keys,
            allowed_hosts=tuple(h.strip() for h in hosts.split(",") if h.strip()),
            completions_special_tokens=args.completions_special_tokens,
        )
        return cls(
            models=ModelSettings(
                tuple(args.model_repository), args.load_models, args.model_config_name
            ),
            network=NetworkSettings(
                args.http_port, args.grpc_port, args.metrics_port, args.host, args.max_body_bytes
            ),
            server=TritonSettings(
                args.tritonserver,
                args.backend_directory,
                args.log_verbose,
                args.exit_timeout_secs,
                args.ready_timeout_secs,
                cpu_threads=args.cpu_threads or None,
            ),
            security=SecuritySettings(secrets.admin_key, access, args.user),
            pair=pair,
            costs=CostSettings(
                args.cost_tables, args.cost_cache, args.remeasure_costs, args.costs_only
            ),
            restart=RestartSettings(args.max_restarts, args.restart_window_s),
            argv=tuple(argv),
        )


def _pair(args: argparse.Namespace) -> tuple[PairSettings, Sequence[str]]:
    """The pair's settings, a --draft-model / --target-model naming a .gguf file replaced by its
    converted directory, and the command line a re-execution gets: the directory appended
    (argparse keeps an option's last value). GGUFError (a ValueError) naming the file for one
    that cannot be converted."""
    argv = list(args.argv)
    models = {}
    for option, dest in (("--draft-model", "draft_model"), ("--target-model", "target_model")):
        given = getattr(args, dest)
        models[dest] = given
        if given is None:
            continue
        directory = model_directory(given, args.gguf_cache, option)
        if directory != given:
            models[dest] = directory
            argv += [option, str(directory)]
    pair = PairSettings(
        **models,
        target_dtype=args.target_dtype,
        draft_dtype=args.draft_dtype,
        engine=args.engine,
        target_gguf=args.target_gguf,
        engine_threads=args.engine_threads,
        gguf_cache=args.gguf_cache,
    )
    return pair, argv
