"""When the gRPC relay ends an idle stream: no request sent within
`stream_first_request_timeout_s` of opening, or none in progress for `stream_idle_timeout_s`
since its last answer (front.grpc_relay; the stream is ended with UNAVAILABLE).

A request is in progress from the moment it is sent upstream until its last response reaches
the client, which Triton marks on a decoupled model's responses (`triton_final_response`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from tritonclient.grpc import service_pb2

FINAL_RESPONSE = "triton_final_response"  # response parameter Triton sets on decoupled models


def completes_request(response: bytes) -> bool:
    """Whether a ModelStreamInfer response is its request's last one.

    Triton marks every response of a decoupled model with `triton_final_response`; a model that
    is not decoupled answers each request once, unmarked.
    """
    try:
        message = service_pb2.ModelStreamInferResponse.FromString(response)
    except Exception:  # protobuf's DecodeError; unknown counts as "still in progress"
        return False
    parameters = message.infer_response.parameters
    final = parameters.get(FINAL_RESPONSE)
    return final is None or final.bool_param


@dataclass
class StreamActivity:
    """What makes a stream idle: no request in progress (none sent and still unanswered) since
    `quiet_since` (loop time), for the idle timeout. A stream waiting on a long generation is
    busy however long it waits, and a client gets the whole timeout after each answer."""

    quiet_since: float
    pending: int = 0  # requests sent upstream whose last response has not reached the client
    used: bool = False  # a request was sent on this stream

    def sent(self) -> None:
        self.pending += 1
        self.used = True

    def answered(self, response: bytes, now: float) -> None:
        if self.pending and completes_request(response):
            self.pending -= 1
            if not self.pending:
                self.quiet_since = now

    def limit_s(self, first_s: float, idle_s: float) -> float:
        """The idle limit that applies: `first_s` until a request was sent, then `idle_s`."""
        return idle_s if self.used else first_s

    def idle_at(self, first_s: float, idle_s: float) -> float | None:
        """When the stream becomes idle (loop time); None while a request is in progress."""
        return None if self.pending else self.quiet_since + self.limit_s(first_s, idle_s)


async def end_when_idle(
    activity: StreamActivity,
    first_s: float,
    idle_s: float,
    end: Callable[[grpc.StatusCode, str], None],
) -> None:
    """End the stream with UNAVAILABLE once it has been idle past its limit (StreamActivity)."""
    loop = asyncio.get_running_loop()
    while (idle_at := activity.idle_at(first_s, idle_s)) is None or loop.time() < idle_at:
        wait = min(first_s, idle_s) / 2 if idle_at is None else idle_at - loop.time()
        await asyncio.sleep(wait)
    limit = activity.limit_s(first_s, idle_s)
    what = "no request in progress" if activity.used else "no request sent"
    message = (
        f"stream closed by the server: {what} for {limit:g} s (idle limit); open a new stream "
        "when you have a request"
    )
    end(grpc.StatusCode.UNAVAILABLE, message)
