"""Admission control through the real server: a bounded queue, and fairness between clients.

Before: one gRPC stream queued 640 requests in 0.03 s and another client's 8-token request then
took 22.8 s. Now each client (one gRPC channel) may queue `max_queued_per_client` requests past
the free batch slots; past it requests get "overloaded ... retry", and admission is round robin
over clients, so another client's request joins at the next free slot. And a client holding
every slot gives one up at the next step boundary when another client waits (fair share).
"""

from __future__ import annotations

import threading
import time

from helpers.clients import GrpcStream, post_json
from helpers.server import all_freed, scrape, wait_for

from avspec.serving.host.server_process import ServerProcess
from avspec.serving.repository import EntryParams
from avspec.serving.stages.metrics import metric_value

BATCH = 32  # the session server's speculative max_batch_size (conftest.py)


def test_burst_past_the_queue_limit_is_refused_and_does_not_starve_others(
    server: ServerProcess,
) -> None:
    per_client = EntryParams().max_queued_per_client
    burst = BATCH + per_client + 20
    hog = GrpcStream(server.grpc_url, own_connection=True)
    other = GrpcStream(server.grpc_url, own_connection=True)
    try:
        started = time.monotonic()
        for i in range(burst):
            hog.send(text_input=f"{i} ", max_tokens=48, temperature=0.0, num_draft_tokens=2)
        time.sleep(0.2)  # let the burst land before the other client's request
        other.send(text_input="fair ", max_tokens=4, temperature=0.0)
        result, error = other.next(120)
        waited = time.monotonic() - started  # both from the start of the burst
        assert error is None, str(error)
        outcomes = [hog.next(300) for _ in range(burst)]
        drained = time.monotonic() - started
    finally:
        hog.close()
        other.close()
    refused = [str(e) for r, e in outcomes if e is not None]
    assert refused and all("overloaded" in e and "retry" in e for e in refused), refused[:2]
    # only what the batch and this client's queue could not hold was refused
    assert len(refused) <= burst - per_client, len(refused)
    # the other client's request waited for one free slot, not behind the hog's whole queue
    # (first in, first out it would finish last, with the burst)
    assert waited < 0.75 * drained, f"other took {waited:.1f} s, the burst {drained:.1f} s"


def test_another_client_is_served_while_one_holds_every_slot(server: ServerProcess) -> None:
    """One client fills all 32 batch slots with long streams; another client's short request
    is admitted at the next step boundary (one of the hog's streams pauses, keeping its cache)
    and finishes while every one of the hog's streams still runs. Before the fair share it
    waited for the first of the hog's streams to finish."""
    hog = GrpcStream(server.grpc_url, own_connection=True)
    other = GrpcStream(server.grpc_url, own_connection=True)
    try:
        for i in range(BATCH):
            hog.send(text_input=f"h{i} ", max_tokens=240, temperature=0.0)
        assert wait_for(lambda: live_sequences(server) == BATCH, timeout_s=60)
        started = time.monotonic()
        other.send(text_input="fair ", max_tokens=8, temperature=0.0, stream=True)
        arrivals = []
        while True:
            result, error = other.next(120)
            assert error is None, str(error)
            arrivals.append(time.monotonic() - started)
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
        assert hog.results.empty(), "one of the hog's streams finished first"
    finally:
        hog.close(cancel=True)
        other.close()
    assert wait_for(lambda: all_freed(server), timeout_s=60)
    steps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    step_s = sorted(steps)[len(steps) // 2]
    print(
        f"other client: first token {arrivals[0] * 1e3:.0f} ms = {arrivals[0] / step_s:.1f} "
        f"steps of {step_s * 1e3:.0f} ms (batch {BATCH}); done after {arrivals[-1] * 1e3:.0f} ms"
    )
    assert arrivals[0] < 4 * step_s + 0.5  # admitted at once: one step, plus the BLS jitter


def live_sequences(server: ServerProcess) -> float:
    return metric_value(scrape(server), "av_live_sequences")


def test_oversized_prompts_are_refused_untokenized_and_do_not_slow_others(
    server: ServerProcess,
) -> None:
    """Four loops send 1 MB prompts (the front's body limit) while another client generates.

    Before, the entry tokenized each one inside `execute` before the context check refused it,
    blocking every other request meanwhile: another client's latency rose from 0.17 s to 5-8 s.
    Now the entry refuses them by their byte length, untokenized, naming text_input and the
    bound, and tokenizes what it keeps on worker threads."""
    url = f"{server.http_url}/v2/models/speculative/generate"
    huge = {"text_input": "x" * 1_000_000, "max_tokens": 8}
    small = {"text_input": "fair ", "max_tokens": 8, "temperature": 0.0}

    def latency() -> float:
        started = time.monotonic()
        status, body = post_json(url, small)
        assert status == 200, body
        return time.monotonic() - started

    idle = sorted(latency() for _ in range(3))[1]
    stop, refusals = threading.Event(), []

    def flood() -> None:
        while not stop.is_set():
            refusals.append(post_json(url, huge))

    loops = [threading.Thread(target=flood) for _ in range(4)]
    for loop in loops:
        loop.start()
    try:
        time.sleep(0.5)
        loaded = sorted(latency() for _ in range(5))[2]
    finally:
        stop.set()
        for loop in loops:
            loop.join(60)
    print(
        f"another client's 8-token request: {idle:.2f} s idle, {loaded:.2f} s under 4 loops of "
        f"1 MB prompts ({len(refusals)} refused)"
    )
    assert refusals
    for status, body in refusals:
        assert status == 400 and "text_input is 1000000 bytes; at most" in body, body[:300]
    assert loaded < idle + 1.0
