"""The deployment's settings (avspec.serving.host.settings): made once of the command line and
the environment, frozen, the keys never in a repr."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from avspec.serving.exposure import ADMIN_KEY_ENV, API_KEYS_ENV
from avspec.serving.host.cli import parse_args
from avspec.serving.host.settings import (
    ALLOWED_HOSTS_ENV,
    ModelSettings,
    ServeSettings,
)

KEY = "operator-key-0123456789"
USER = "10001" if os.geteuid() == 0 else str(os.geteuid())  # a --user this process may give


def _settings(*options: str, environ: dict[str, str] | None = None) -> ServeSettings:
    args = parse_args(["--model-repository", "repo", *options])
    return ServeSettings.from_args(args, {} if environ is None else environ)


def test_the_command_line_lands_in_its_group() -> None:
    settings = _settings(
        "--model-repository", "second", "--http-port", "1", "--grpc-port", "2",
        "--metrics-port", "3", "--cpu-threads", "0", "--load-model", "a", "--load-model", "b",
        "--model-config-name", "gpu", "--max-restarts", "2", "--restart-window-s", "60",
        "--exit-timeout-secs", "30", "--user", USER,
    )  # fmt: skip
    models = settings.models
    assert models.repositories == (Path("repo").resolve(), Path("second").resolve())
    assert models.load_models == ("a", "b") and models.model_config_name == "gpu"
    network = settings.network
    assert (network.http_port, network.grpc_port, network.metrics_port) == (1, 2, 3)
    assert network.host == "0.0.0.0"  # the command line's default: every address
    assert settings.server.cpu_threads is None  # 0: OMP_NUM_THREADS left as is
    assert settings.server.exit_timeout_s == 30 and settings.server.supervise
    budget = settings.restart.budget()
    assert (budget.max_restarts, budget.window_s) == (2, 60)
    assert settings.security.user == USER
    assert settings.argv[:2] == ("--model-repository", "repo")  # for the re-execution


def test_settings_are_frozen_and_replaced_whole() -> None:
    settings = ServeSettings(ModelSettings((Path("a"), Path("b"))))
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.network = settings.network  # type: ignore[misc]
    served = settings.serving(Path("/tmp/copy"))
    assert served.models.repositories == (Path("/tmp/copy"), Path("b").resolve())
    assert settings.models.repositories[0] == Path("a").resolve()
    with pytest.raises(TypeError, match="sequence of paths"):
        ModelSettings(Path("a"))  # type: ignore[arg-type]


def test_keys_are_read_once_and_never_shown(monkeypatch: pytest.MonkeyPatch) -> None:
    environ = {ADMIN_KEY_ENV: KEY, API_KEYS_ENV: "alice alice-key-0123", "OTHER": "kept"}
    settings = _settings(environ=environ)
    assert settings.security.admin_key == KEY
    assert settings.security.access.api_keys == (("alice", "alice-key-0123"),)
    assert environ == {"OTHER": "kept"}  # no child inherits them
    shown = repr(settings)
    assert KEY not in shown and "alice-key-0123" not in shown
    assert KEY not in repr(settings.security.secrets())


def test_allowed_hosts_from_the_option_or_the_environment() -> None:
    environ = {ALLOWED_HOSTS_ENV: "a.example, b.example"}
    assert _settings(environ=environ).security.access.allowed_hosts == ("a.example", "b.example")
    given = _settings("--allowed-hosts", "c.example", environ=environ)
    assert given.security.access.allowed_hosts == ("c.example",)
    assert _settings().security.access.allowed_hosts == ()


def test_a_bad_api_key_fails_when_the_settings_are_made() -> None:
    with pytest.raises(ValueError, match="at least"):
        _settings(environ={API_KEYS_ENV: "alice short"})


def test_cost_options_follow_the_threads() -> None:
    settings = _settings("--cost-cache", "/c", "--remeasure-costs", "--cpu-threads", "2")
    options = settings.costs.options(settings.server.cpu_threads)
    assert (options.cpu_threads, options.cache, options.remeasure) == (2, Path("/c"), True)
    assert settings.stage_settings() == {}
    tables = _settings("--cost-tables", "t.json").stage_settings()
    assert tables == {"verifier": {"cost_tables": str(Path("t.json").resolve())}}
