"""avspec.tools.bench.soak.drain: the live-sequence gauges after the load."""

from __future__ import annotations

import urllib.error

import pytest

from avspec.serving.host.server_process import free_port
from avspec.tools.bench.soak.drain import live_sequences, wait_drained

METRICS = b"""# HELP av_live_sequences Live sequences
# TYPE av_live_sequences gauge
av_live_sequences 0
av_kv_live_sequences{model="target",stage="1"} %d
nv_inference_count{model="speculative"} 12
"""


def test_live_sequences_keeps_the_live_gauges(canned):
    canned.routes["/metrics"] = (200, METRICS % 0)
    assert live_sequences(canned.url + "/metrics") == {
        "av_kv_live_sequences{model=target,stage=1}": 0.0,
        "av_live_sequences": 0.0,
    }


def test_wait_drained_returns_once_all_are_zero(canned):
    canned.routes["/metrics"] = (200, METRICS % 0)
    assert not any(wait_drained(canned.url + "/metrics", timeout_s=10).values())
    assert canned.hits["/metrics"] == 1


def test_wait_drained_gives_the_last_reading_after_the_timeout(canned):
    canned.routes["/metrics"] = (200, METRICS % 2)
    live = wait_drained(canned.url + "/metrics", timeout_s=0.6)
    assert live["av_kv_live_sequences{model=target,stage=1}"] == 2.0
    assert canned.hits["/metrics"] >= 2


def test_unreachable_metrics_raise_oserror():
    with pytest.raises(urllib.error.URLError):
        live_sequences(f"http://127.0.0.1:{free_port()}/metrics")
