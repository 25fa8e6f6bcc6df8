"""The launcher's own logic without a server (avspec.serving.host.launcher and its parts): the
restart loop (serve), how the operator's key reaches the sandboxed launcher (keys, settings), and
.gguf models converted before the pair check and before the launcher re-executes itself."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers.gguf_files import TinyLlama, llama_weights, write_llama_gguf

from avspec.serving.exposure import ADMIN_KEY_ENV, API_KEYS_ENV
from avspec.serving.host import launcher, serve, served_repository
from avspec.serving.host.cli import parse_args
from avspec.serving.host.keys import ADMIN_KEY_FD_ENV, Secrets, pipe_secrets
from avspec.serving.host.restart import RestartBudget
from avspec.serving.host.sandbox import SANDBOXED_ENV, ServerUser
from avspec.serving.host.server_process import ServerError
from avspec.serving.host.settings import ServeSettings

KEY = "operator-key-0123456789"


class DyingProcess:
    """A tritonserver that has exited with `code`."""

    def __init__(self, code: int) -> None:
        self.code = code

    def poll(self) -> int:
        return self.code


class FakeServer:
    """Dies at once after each start; `restart` fails for the attempts listed in `failing`."""

    def __init__(self, failing: set[int] = frozenset()) -> None:
        self.process = DyingProcess(-9)
        self.restarts = 0
        self.down: list[str] = []
        self.failing = failing

    def mark_down(self, message: str) -> None:
        self.down.append(message)

    def restart(self) -> None:
        self.restarts += 1
        if self.restarts in self.failing:
            raise ServerError("not ready")
        self.process = DyingProcess(-6)


def test_a_dying_server_is_restarted_until_the_budget_is_spent(
    capsys: pytest.CaptureFixture,
) -> None:
    server = FakeServer(failing={2})
    budget = RestartBudget(max_restarts=3, window_s=600, first_delay_s=0, max_delay_s=0)
    code = serve.keep_serving(server, budget)
    assert code == -6 and server.restarts == 3  # the third restart's death spent the budget
    err = capsys.readouterr().err
    assert err.count("restarting in") == 3 and "restart failed: not ready" in err
    assert "giving up" in err
    assert all("retry shortly" in message for message in server.down)


def test_no_restart_allowed_exits_with_the_server(capsys: pytest.CaptureFixture) -> None:
    server = FakeServer()
    assert serve.keep_serving(server, RestartBudget(max_restarts=0)) == -9
    assert server.restarts == 0 and "giving up" in capsys.readouterr().err


def test_the_key_crosses_the_exec_through_a_pipe_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sandboxed launcher reads the key from the inherited pipe, closes it, and the
    environment names neither the key nor the pipe afterwards."""
    given = Secrets(KEY, (("alice", "alice-key-0123"),))
    read_end = pipe_secrets(given)
    monkeypatch.setenv(ADMIN_KEY_FD_ENV, str(read_end))
    monkeypatch.setenv(ADMIN_KEY_ENV, "ignored-because-the-pipe-wins-0123")
    monkeypatch.setenv(API_KEYS_ENV, "ignored-because-the-pipe-wins")
    args = parse_args(["--model-repository", "x"])
    assert ServeSettings.from_args(args, os.environ).security.secrets() == given
    assert ADMIN_KEY_FD_ENV not in os.environ
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed


def test_the_key_variable_is_removed_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ADMIN_KEY_FD_ENV, raising=False)
    monkeypatch.setenv(ADMIN_KEY_ENV, KEY)
    monkeypatch.setenv(API_KEYS_ENV, "alice alice-key-0123, bob-key-4567")
    settings = ServeSettings.from_args(parse_args(["--model-repository", "x"]), os.environ)
    secrets = settings.security.secrets()
    assert secrets.admin_key == KEY and secrets.api_keys[0] == ("alice", "alice-key-0123")
    assert secrets.api_keys[1][1] == "bob-key-4567"  # named by its hash's start
    assert ADMIN_KEY_ENV not in os.environ and API_KEYS_ENV not in os.environ


def _tiny_gguf(path: Path, architecture: str = "llama") -> Path:
    shape = TinyLlama()
    return write_llama_gguf(path, shape, llama_weights(shape, seed=0), architecture=architecture)


class _Stop(ValueError):
    """Raised by the stubbed pair check: what it saw is all the test needs."""


def test_a_gguf_target_reaches_the_pair_check_as_its_converted_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """`--target-model x.gguf`: converted under --gguf-cache before `prepare_pair`, which gets
    the directory; a directory given as the draft is passed on as it is."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_FD_ENV, raising=False)
    gguf = _tiny_gguf(tmp_path / "target.gguf")
    draft = tmp_path / "draft"
    draft.mkdir()
    seen = {}

    def prepare_pair(repository: Path, draft_dir: Path | None, target_dir: Path | None) -> None:
        seen.update(repository=repository, draft=draft_dir, target=target_dir)
        raise _Stop("stub pair check")

    monkeypatch.setattr(served_repository, "prepare_pair", prepare_pair)
    cache = tmp_path / "cache"
    argv = ["--model-repository", str(tmp_path / "repo"), "--gguf-cache", str(cache)]
    argv += ["--draft-model", str(draft), "--target-model", str(gguf)]
    assert launcher.main(argv) == 1
    assert seen["draft"] == draft.resolve()
    assert seen["target"].is_dir() and seen["target"].parent.parent == cache.resolve()
    assert (seen["target"] / "config.json").is_file()
    err = capsys.readouterr().err
    assert "avspec: --target-model: converting target.gguf" in err
    assert "avspec: stub pair check" in err


def test_the_reexecuted_launcher_gets_the_converted_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started as root, the launcher converts before it drops root: the sandbox's paths and
    the re-executed command line name the converted directory, never the .gguf file."""
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_FD_ENV, raising=False)
    monkeypatch.delenv(SANDBOXED_ENV, raising=False)
    gguf = _tiny_gguf(tmp_path / "target.gguf")
    monkeypatch.setattr(serve, "server_user", lambda spec: ServerUser(10001, 10001))
    reexecuted = []

    def reexec(settings: ServeSettings, user: ServerUser) -> None:
        reexecuted.append(settings)
        raise OSError("exec stubbed")

    monkeypatch.setattr(serve, "reexec_sandboxed", reexec)
    argv = ["--model-repository", "repo", "--target-model", str(gguf)]
    args = parse_args([*argv, "--gguf-cache", str(tmp_path / "cache")])
    assert serve.serve(ServeSettings.from_args(args, os.environ), reexec=True) == 1
    (given,) = reexecuted
    target = given.pair.target_model
    assert target.is_dir() and target.name == "bfloat16"
    again = parse_args(list(given.argv))  # what the sandboxed launcher parses
    assert again.target_model == target and again.draft_model is None
    settings = ServeSettings.from_args(again, os.environ)  # and makes its settings of
    assert settings.pair.target_model == target and settings.argv == given.argv


def test_a_bad_gguf_model_exits_1_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_FD_ENV, raising=False)
    monkeypatch.setattr(served_repository, "prepare_pair", pytest.fail)  # never reached
    gguf = _tiny_gguf(tmp_path / "qwen.gguf", architecture="qwen2")
    argv = ["--model-repository", "repo", "--gguf-cache", str(tmp_path / "cache")]
    assert launcher.main([*argv, "--draft-model", str(gguf)]) == 1
    err = capsys.readouterr().err
    assert f"avspec: --draft-model {gguf}: architecture 'qwen2' is not supported" in err
    assert launcher.main([*argv, "--target-model", str(tmp_path / "none.gguf")]) == 1
    assert "none.gguf: no such GGUF file" in capsys.readouterr().err
