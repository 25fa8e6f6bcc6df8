"""Faults injected into the running server: killed stage stubs (issue: self-healing stages).

On the previous deployment a stub killed with SIGKILL was never restarted: the model kept
answering ready while every request failed, and a request in flight on the entry model hung
forever. Here the supervisor must notice, turn readiness false, reload the model, and every
client must get an answer: an error for what was in flight, success afterwards.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from helpers.clients import GrpcStream, http_generate
from helpers.server import all_freed, wait_for

from avspec.serving.server_process import ServerProcess
from avspec.serving.supervisor import find_stubs

RECOVERY_S = 30


def ready_status(server: ServerProcess) -> int:
    try:
        with urllib.request.urlopen(f"{server.http_url}/v2/health/ready", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


def kill_stub(server: ServerProcess, model: str) -> int:
    stub = find_stubs(server.process.pid, server.model_repository)[model]
    os.kill(stub.pid, signal.SIGKILL)
    return stub.pid


def wait_recovered(server: ServerProcess, model: str, restarts: int) -> None:
    deadline = time.monotonic() + RECOVERY_S
    while server.supervisor.restarts[model] <= restarts or ready_status(server) != 200:
        assert time.monotonic() < deadline, f"{model} not recovered in {RECOVERY_S} s"
        time.sleep(0.1)


class StreamInFlight:
    """A long gRPC stream on a thread: records its outcome (text or error) and when."""

    def __init__(self, server: ServerProcess) -> None:
        self.stream = GrpcStream(server.grpc_url)
        self.outcome: str | None = None
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(60), "the stream never produced a first response"

    def _run(self) -> None:
        self.stream.send(text_input="def ", max_tokens=200, stream=True, temperature=1.0)
        while True:
            result, error = self.stream.next(RECOVERY_S * 2)
            self.started.set()
            if error is not None:
                self.outcome = f"error: {error}"
                return
            if result.get_response().parameters["triton_final_response"].bool_param:
                self.outcome = "finished"
                return

    def result(self) -> str:
        self.thread.join(RECOVERY_S)
        self.stream.close()
        assert self.outcome is not None, "the in-flight request hung"
        return self.outcome


@pytest.mark.parametrize("model", ["verifier", "draft", "target", "speculative"])
def test_killed_stub_is_reloaded_and_in_flight_requests_get_an_answer(
    server: ServerProcess, model: str
) -> None:
    restarts = server.supervisor.restarts[model]
    in_flight = StreamInFlight(server)
    old = kill_stub(server, model)
    outcome = in_flight.result()
    # the request either finished before the kill reached it, or failed with a clear error
    assert outcome == "finished" or "error" in outcome
    if model == "speculative":
        assert "restarted" in outcome or outcome == "finished"
    wait_recovered(server, model, restarts)
    assert find_stubs(server.process.pid, server.model_repository)[model].pid != old
    assert len(http_generate(server.http_url, text_input="again", max_tokens=6).text) == 6
    # nothing of the lost request stays behind: every KV cache slot is free again (an entry
    # restart reloads draft and target too, whose caches held the dead scheduler's sequences)
    assert wait_for(lambda: all_freed(server)), "KV cache slots leaked"


def test_readiness_is_false_while_a_stage_is_down(server: ServerProcess) -> None:
    seen: list[int] = []
    supervisor = server.supervisor
    original = supervisor.reload

    def reload(model: str) -> None:  # runs on the supervisor's thread, mid-recovery
        seen.append(ready_status(server))
        original(model)

    restarts = supervisor.restarts["verifier"]
    supervisor.reload = reload
    try:
        kill_stub(server, "verifier")
        wait_recovered(server, "verifier", restarts)
    finally:
        supervisor.reload = original
    assert seen and seen[0] == 503
    assert ready_status(server) == 200
