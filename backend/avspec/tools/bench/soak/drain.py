"""Live sequences after the load: a cancelled request that keeps its slot is a leak.

Read from the server's Prometheus metrics (av_live_sequences, av_kv_live_sequences), which
should all reach 0 once every request has ended.
"""

from __future__ import annotations

import time
import urllib.request

from avspec.serving.stages.metrics import parse_metrics

LIVE_METRICS = ("av_live_sequences", "av_kv_live_sequences")


def live_sequences(metrics_url: str) -> dict[str, float]:
    """The av_live_sequences / av_kv_live_sequences samples, `name{labels}` -> value."""
    with urllib.request.urlopen(metrics_url, timeout=10) as response:
        samples = parse_metrics(response.read().decode())
    out = {}
    for (name, labels), value in samples.items():
        if name in LIVE_METRICS:
            suffix = ",".join(f"{k}={v}" for k, v in sorted(labels))
            out[f"{name}{{{suffix}}}" if suffix else name] = value
    return dict(sorted(out.items()))


def wait_drained(metrics_url: str, timeout_s: float) -> dict[str, float]:
    """Poll live_sequences until every value is 0 or `timeout_s` passes; the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        live = live_sequences(metrics_url)
        if not any(live.values()) or time.monotonic() > deadline:
            return live
        time.sleep(0.5)
