"""The launcher's own logic without a server (avspec.serving.launcher): the restart loop and how
the operator's key reaches the sandboxed launcher."""

from __future__ import annotations

import os

import pytest

from avspec.serving import launcher
from avspec.serving.exposure import ADMIN_KEY_ENV
from avspec.serving.restart import RestartBudget
from avspec.serving.server_process import ServerError

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
    code = launcher._keep_serving(server, budget)
    assert code == -6 and server.restarts == 3  # the third restart's death spent the budget
    err = capsys.readouterr().err
    assert err.count("restarting in") == 3 and "restart failed: not ready" in err
    assert "giving up" in err
    assert all("retry shortly" in message for message in server.down)


def test_no_restart_allowed_exits_with_the_server(capsys: pytest.CaptureFixture) -> None:
    server = FakeServer()
    assert launcher._keep_serving(server, RestartBudget(max_restarts=0)) == -9
    assert server.restarts == 0 and "giving up" in capsys.readouterr().err


def test_the_key_crosses_the_exec_through_a_pipe_and_leaves_no_trace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The sandboxed launcher reads the key from the inherited pipe, closes it, and the
    environment names neither the key nor the pipe afterwards."""
    read_end, write_end = os.pipe()
    os.write(write_end, KEY.encode())
    os.close(write_end)
    monkeypatch.setenv(launcher.ADMIN_KEY_FD_ENV, str(read_end))
    monkeypatch.setenv(ADMIN_KEY_ENV, "ignored-because-the-pipe-wins-0123")
    args = launcher.parse_args(["--model-repository", "x"])
    assert launcher._admin_key(args) == KEY
    assert launcher.ADMIN_KEY_FD_ENV not in os.environ
    with pytest.raises(OSError):
        os.fstat(read_end)  # closed


def test_the_key_variable_is_removed_once_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(launcher.ADMIN_KEY_FD_ENV, raising=False)
    monkeypatch.setenv(ADMIN_KEY_ENV, KEY)
    assert launcher._admin_key(launcher.parse_args(["--model-repository", "x"])) == KEY
    assert ADMIN_KEY_ENV not in os.environ  # no child inherits it
