"""The serve loop: start the server on the settings, keep it serving, stop on a signal.

It prints one line when every model is ready; the first SIGINT/SIGTERM stops the server
gracefully (`StopRequested`). A tritonserver that dies is started again
(avspec.serving.host.restart: backoff, at most --max-restarts per --restart-window-s) while the
front answers 503 with Retry-After.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from avspec.serving.host.reexec import reexec_sandboxed
from avspec.serving.host.restart import RestartBudget
from avspec.serving.host.sandbox import SANDBOXED_ENV, server_user
from avspec.serving.host.served_repository import served_settings
from avspec.serving.host.server_process import ServerError, ServerProcess
from avspec.serving.host.settings import ServeSettings


class StopRequested(Exception):
    """Raised in the main thread by the first SIGINT/SIGTERM (`request_stop`), never twice."""


def request_stop(signum: int, frame: object) -> None:
    """The launcher's SIGINT/SIGTERM handler: disarm, then raise StopRequested in the main thread.

    Raising is what interrupts a start still waiting for the models. It must happen once: make
    forwards SIGTERM twice, 50 ms apart, and a second raise would land in the stop the first
    one started. So it first swaps itself for a handler that only reports; `ServerProcess.stop`
    holds the signals itself while it runs, and the launcher restores the original handlers.
    """

    def already_stopping(late: int, _: object) -> None:
        with contextlib.suppress(OSError):  # os.write: a print may be under way in main
            os.write(2, f"avspec: {signal.Signals(late).name} ignored, stopping\n".encode())

    for handled in (signal.SIGINT, signal.SIGTERM):
        signal.signal(handled, already_stopping)
    raise StopRequested(signal.Signals(signum).name)


def serve(settings: ServeSettings, reexec: bool) -> int:
    """Serve until the server dies past its restart budget or a signal; the exit status.

    Started as root outside the sandbox with `reexec` (the process's own command line), the
    launcher executes itself again in the sandbox (avspec.serving.host.reexec); otherwise it
    keeps its process, and only tritonserver and its stubs are sandboxed (ServerProcess).
    """
    try:
        sandboxed = bool(os.environ.get(SANDBOXED_ENV))
        user = server_user(settings.security.user) if not sandboxed else None
        if user is not None and reexec:
            reexec_sandboxed(settings, user)  # returns only on failure
        elif user is None and os.geteuid() == 0 and not sandboxed:
            print("avspec: --user root: tritonserver and its stubs run as root", flush=True)
    except (ValueError, OSError, ServerError) as err:
        print(f"avspec: {err}", file=sys.stderr, flush=True)
        return 1
    with tempfile.TemporaryDirectory(prefix="avspec-repository-") as workdir:
        return _serve_in(settings, Path(workdir))


def _serve_in(settings: ServeSettings, workdir: Path) -> int:
    server = None
    try:
        settings = served_settings(settings, workdir)
        if settings.costs.only:
            return 0
        server = ServerProcess(settings)
        server.start()
        admin = "open with the operator's key" if server.admin_key else "closed"
        keys = len(settings.security.access.api_keys)
        if keys:
            print(f"avspec: inference needs an API key ({keys} configured)", flush=True)
        print(
            f"avspec: serving {len(server.models)} models on {server.host}, "
            f"HTTP :{server.http_port} gRPC :{server.grpc_port} metrics :{server.metrics_port} "
            f"(public: inference on {server.public_model!r}, health, metrics; admin API "
            f"{admin})",
            flush=True,
        )
        code = keep_serving(server, settings.restart.budget())
        server.stop()
        return code or 1
    except (ServerError, ValueError, OSError) as err:
        print(f"avspec: {err}", file=sys.stderr, flush=True)
        if server is not None:
            server.stop()
        return 1
    except StopRequested as why:
        code = server.stop() if server is not None else None
        print(f"avspec: stopped on {why} (tritonserver exit code {code})", flush=True)
        return 0


def keep_serving(server: ServerProcess, budget: RestartBudget) -> int | None:
    """Watch tritonserver; start it again when it dies, until the restart budget is spent.

    Returns the exit code of the death that exhausted the budget. The front stays up throughout
    and answers 503 with Retry-After while tritonserver is down.
    """
    while True:
        while (code := server.process.poll()) is None:  # type: ignore[union-attr]
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
