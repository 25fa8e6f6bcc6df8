"""Small clients of the `speculative` model for the serving tests: HTTP generate, SSE, gRPC."""

from __future__ import annotations

import json
import queue
import urllib.error
import urllib.request
from dataclasses import dataclass

import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from avspec.tools.bench.soak.tensors import infer_inputs

MODEL = "speculative"


@dataclass
class Generation:
    """What a client got back: text and the drafted / verified / accepted totals."""

    text: str
    drafted: int
    verified: int
    accepted: int
    responses: int


def post_json(url: str, payload: dict, timeout: float = 120) -> tuple[int, str]:
    """POST JSON; return (status, body), also for HTTP errors."""
    data = json.dumps(payload).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def http_generate(base_url: str, **payload: object) -> Generation:
    """POST /v2/models/speculative/generate (stream false); AssertionError on an error status."""
    status, body = post_json(f"{base_url}/v2/models/{MODEL}/generate", payload)
    assert status == 200, body
    out = json.loads(body)
    return Generation(
        out["text_output"],
        out["drafted_tokens"],
        out["verified_tokens"],
        out["accepted_tokens"],
        1,
    )


def http_generate_stream(base_url: str, **payload: object) -> list[dict]:
    """POST /generate_stream; return the server-sent events' JSON objects in order."""
    data = json.dumps({**payload, "stream": True}).encode()
    request = urllib.request.Request(
        f"{base_url}/v2/models/{MODEL}/generate_stream",
        data=data,
        headers={"Content-Type": "application/json"},
    )
    events = []
    with urllib.request.urlopen(request, timeout=120) as response:
        for raw in response:
            line = raw.decode().strip()
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:") :]))
    return events


def _from_result(result, responses: int) -> Generation:
    text = result.as_numpy("text_output")[0].decode()
    counts = [int(result.as_numpy(n)[0]) for n in ("drafted_tokens", "verified_tokens")]
    return Generation(text, *counts, int(result.as_numpy("accepted_tokens")[0]), responses)


def tritonclient_http_generate(url: str, **values: object) -> Generation:
    """Non-streaming inference with tritonclient.http (one response)."""
    with httpclient.InferenceServerClient(url) as client:
        result = client.infer(MODEL, infer_inputs(httpclient, values))
    return _from_result(result, 1)


class GrpcStream:
    """A tritonclient.grpc bidirectional stream to the `speculative` model."""

    def __init__(self, url: str, own_connection: bool = False) -> None:
        # gRPC shares one TCP connection among channels to the same target unless told not to;
        # own_connection makes this stream a client of its own (the front keys on the peer)
        args = [("grpc.use_local_subchannel_pool", 1)] if own_connection else None
        self.client = grpcclient.InferenceServerClient(url, channel_args=args)
        self.results: queue.Queue = queue.Queue()
        self.client.start_stream(callback=lambda result, error: self.results.put((result, error)))

    def send(self, **values: object) -> None:
        self.client.async_stream_infer(
            MODEL, infer_inputs(grpcclient, values), enable_empty_final_response=True
        )

    def next(self, timeout: float = 120):
        """The next (result, error) pair; result is None when error is set."""
        return self.results.get(timeout=timeout)

    def collect(self, timeout: float = 120) -> Generation:
        """Read responses until the final one; fold the texts and counts together."""
        parts, totals, responses = [], [0, 0, 0], 0
        while True:
            result, error = self.next(timeout)
            if error is not None:
                raise RuntimeError(str(error))
            response = result.get_response()
            if response.outputs:
                responses += 1
                chunk = _from_result(result, responses)
                parts.append(chunk.text)
                step = (chunk.drafted, chunk.verified, chunk.accepted)
                totals = [a + b for a, b in zip(totals, step, strict=True)]
            if response.parameters["triton_final_response"].bool_param:
                return Generation("".join(parts), *totals, responses)

    def close(self, cancel: bool = False) -> None:
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()


def grpc_generate(url: str, **values: object) -> Generation:
    """One request over a gRPC stream (stream true or false), collected to the final response."""
    stream = GrpcStream(url)
    try:
        stream.send(**values)
        return stream.collect()
    finally:
        stream.close()
