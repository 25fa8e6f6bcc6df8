"""Admission control through the real server: a bounded queue, and fairness between clients.

Before: one gRPC stream queued 640 requests in 0.03 s and another client's 8-token request then
took 22.8 s. Now each client (one gRPC channel) may queue `max_queued_per_client` requests past
the free batch slots; past it requests get "overloaded ... retry", and admission is round robin
over clients, so another client's request joins at the next free slot.
"""

from __future__ import annotations

import time

from helpers.clients import GrpcStream

from avspec.serving.repository import EntryParams
from avspec.serving.server_process import ServerProcess

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
