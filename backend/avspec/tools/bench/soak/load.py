"""The soak's load: one request over its protocol, the outcome tally, the client loops.

A request is ok, cancelled or failed (RequestFailed, its message kept). Cancelling a streaming
request: the gRPC stream is stopped with cancel_requests, the HTTP connection closed; Triton then
cancels the request on the server. Each loop sends one request after another until a deadline.
"""

from __future__ import annotations

import json
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import tritonclient.grpc as grpcclient

from avspec.tools.bench.soak.mix import PROTOCOLS, Mix, RequestSpec, draw_request
from avspec.tools.bench.soak.tensors import MODEL, infer_inputs

MAX_KEPT_ERRORS = 1000  # a dead server fails every request: keep the first ones, count the rest
FAILURE_PAUSE_S = 1.0  # after a failure, so a dead server is not hammered in a tight loop
OUTCOMES = ("ok", "failed", "cancelled")


class RequestFailed(Exception):
    """A request ended in an error; the message is what the report keeps."""


@dataclass(frozen=True)
class Endpoints:
    """Where the server answers."""

    grpc_url: str
    http_url: str
    metrics_url: str | None = None


def payload(spec: RequestSpec, stream: bool) -> dict[str, Any]:
    """The generate body (HTTP) or input values (gRPC) of `spec`."""
    body: dict[str, Any] = {
        "text_input": spec.prompt,
        "max_tokens": spec.max_tokens,
        "temperature": spec.temperature,
        "random_seed": spec.seed,
        "stream": stream,
    }
    if spec.num_draft_tokens is not None:
        body["num_draft_tokens"] = spec.num_draft_tokens
    return body


def _http_post(url: str, body: dict, timeout: float) -> Any:
    """urlopen a JSON POST; RequestFailed on an HTTP error status (network errors propagate)."""
    request = urllib.request.Request(
        url, json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        return urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as err:
        raise RequestFailed(
            f"HTTP {err.code}: {err.read().decode(errors='replace')[:300]}"
        ) from None


def http_generate(base_url: str, spec: RequestSpec, timeout: float) -> str:
    """POST /generate; "ok" or RequestFailed."""
    url = f"{base_url}/v2/models/{MODEL}/generate"
    with _http_post(url, payload(spec, False), timeout) as response:
        body = response.read()
    try:
        out = json.loads(body)
    except json.JSONDecodeError:
        raise RequestFailed(f"/generate answered non-JSON: {body[:300]!r}") from None
    if "text_output" not in out:
        raise RequestFailed(f"/generate answered without text_output: {body[:300]!r}")
    return "ok"


def http_generate_stream(base_url: str, spec: RequestSpec, timeout: float) -> str:
    """POST /generate_stream and read the events; "ok", "cancelled" or RequestFailed.

    Cancelling = closing the connection after `cancel_after` events (the `with` block does).
    """
    url = f"{base_url}/v2/models/{MODEL}/generate_stream"
    events = 0
    with _http_post(url, payload(spec, True), timeout) as response:
        for raw in response:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            event = json.loads(line[len("data:") :])
            if "error" in event:
                raise RequestFailed(f"/generate_stream event: {event['error']}")
            events += 1
            if spec.cancel_after is not None and events >= spec.cancel_after:
                return "cancelled"
    if not events:
        raise RequestFailed("/generate_stream ended without an event")
    return "ok"


class GrpcStream:
    """One loop's long-lived gRPC stream, reopened after a cancel or an error.

    Each stream gets its own queue, so responses of a cancelled request cannot reach the next.
    """

    def __init__(self, url: str) -> None:
        self.url = url
        self.client: grpcclient.InferenceServerClient | None = None
        self.results: queue.Queue = queue.Queue()

    def _open(self) -> None:
        results: queue.Queue = queue.Queue()
        self.client = grpcclient.InferenceServerClient(self.url)
        self.client.start_stream(callback=lambda result, error: results.put((result, error)))
        self.results = results

    def close(self) -> None:
        """Stop the stream, cancelling whatever it still carries."""
        client, self.client = self.client, None
        if client is not None:
            try:
                client.stop_stream(cancel_requests=True)
            finally:
                client.close()

    def generate(self, spec: RequestSpec, request_id: str, timeout: float) -> str:
        """Send `spec` and read its responses; "ok", "cancelled" or RequestFailed."""
        if self.client is None:
            self._open()
        try:
            return self._exchange(spec, request_id, timeout)
        except BaseException:
            self.close()
            raise

    def _exchange(self, spec: RequestSpec, request_id: str, timeout: float) -> str:
        assert self.client is not None  # opened by `send`
        inputs = infer_inputs(grpcclient, payload(spec, True))
        self.client.async_stream_infer(
            MODEL, inputs, request_id=request_id, enable_empty_final_response=True
        )
        responses = 0
        while True:
            try:
                result, error = self.results.get(timeout=timeout)
            except queue.Empty:
                raise RequestFailed(f"gRPC: no response for {timeout:.0f} s") from None
            if error is not None:
                raise RequestFailed(f"gRPC: {error}")
            response = result.get_response()
            responses += bool(response.outputs)
            if response.parameters["triton_final_response"].bool_param:
                return "ok"
            if spec.cancel_after is not None and responses >= spec.cancel_after:
                self.close()
                return "cancelled"


def send(
    spec: RequestSpec, endpoints: Endpoints, stream: GrpcStream, request_id: str, timeout: float
) -> str:
    """Send one request over its protocol; "ok", "cancelled" or RequestFailed."""
    if spec.protocol == "grpc":
        return stream.generate(spec, request_id, timeout)
    if spec.protocol == "http":
        return http_generate(endpoints.http_url, spec, timeout)
    return http_generate_stream(endpoints.http_url, spec, timeout)


@dataclass
class Tally:
    """Outcomes so far, thread-safe: counts by protocol and outcome, the first error texts."""

    counts: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    failed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, protocol: str, outcome: str, error: str | None = None) -> None:
        with self.lock:
            self.counts[(protocol, outcome)] += 1
            if outcome == "failed":
                self.failed += 1
                if len(self.errors) < MAX_KEPT_ERRORS:
                    self.errors.append(f"{protocol}: {error}")

    def total(self, outcome: str) -> int:
        with self.lock:
            return sum(n for (_, o), n in self.counts.items() if o == outcome)

    def done(self) -> int:
        with self.lock:
            return sum(self.counts.values())

    def by_protocol(self) -> dict[str, dict[str, int]]:
        with self.lock:
            return {p: {o: self.counts[(p, o)] for o in OUTCOMES} for p in PROTOCOLS}


def client_loop(
    index: int,
    endpoints: Endpoints,
    mix: Mix,
    tally: Tally,
    deadline: float,
    seed: int,
    request_timeout: float,
) -> None:
    """Send one request after another until time.monotonic() passes `deadline`."""
    rng = random.Random(seed * 100_003 + index)
    stream = GrpcStream(endpoints.grpc_url)
    n = 0
    try:
        while time.monotonic() < deadline:
            spec = draw_request(rng, mix)
            try:
                outcome = send(spec, endpoints, stream, f"soak-{index}-{n}", request_timeout)
            except Exception as err:  # noqa: BLE001 - network errors etc.: counted, loop goes on
                message = (
                    str(err) if isinstance(err, RequestFailed) else f"{type(err).__name__}: {err}"
                )
                tally.add(spec.protocol, "failed", message)
                time.sleep(FAILURE_PAUSE_S)
            else:
                tally.add(spec.protocol, outcome)
            n += 1
    finally:
        stream.close()


def start_loops(
    concurrency: int,
    endpoints: Endpoints,
    mix: Mix,
    tally: Tally,
    deadline: float,
    seed: int,
    request_timeout: float,
) -> list[threading.Thread]:
    """Start `concurrency` client loops (daemon threads) that stop at `deadline`."""
    threads = [
        threading.Thread(
            target=client_loop,
            args=(i, endpoints, mix, tally, deadline, seed, request_timeout),
            name=f"soak-loop-{i}",
            daemon=True,
        )
        for i in range(concurrency)
    ]
    for thread in threads:
        thread.start()
    return threads


def join_loops(threads: list[threading.Thread], within_s: float) -> int:
    """Wait up to `within_s` in all for the loops to end; how many are still running."""
    join_by = time.monotonic() + within_s
    for thread in threads:
        thread.join(timeout=max(0.0, join_by - time.monotonic()))
    return sum(thread.is_alive() for thread in threads)
