"""client/bench_serving.py end to end against the session's real server, tiny configuration."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from helpers.client_scripts import load_client_script


def test_bench_serving_tiny_sweep(server, tmp_path: Path):
    """Concurrency 1 and 2, arms none / k2 / av8 / ad8, 2 code prompts of 8 tokens: every
    output, and each point's step breakdown from the server's metrics."""
    out = tmp_path / "bench"
    rc = load_client_script("bench_serving").main([
        "--url", server.grpc_url, "--metrics-url", server.metrics_url,
        "--concurrency", "1,2", "--arms", "none,k2,av8,ad8", "--workloads", "code",
        "--prompts", "2", "--max-tokens", "8", "--rounds", "1", "--requests-per-user", "1",
        "--min-requests", "2", "--warmup-requests", "0", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    document = json.loads((out / "points.json").read_text())
    points = {(p["concurrency"], p["arm"]): p for p in document["points"]}
    assert set(points) == {(c, a) for c in (1, 2) for a in ("none", "k2", "av8", "ad8")}
    for (_, arm), p in points.items():
        assert p["requests"] == 2 and p["errors"] == 0
        assert 0 < p["output_tokens"] <= 16 and p["output_tokens_per_s"] > 0
        assert p["ttft_ms_median"] > 0
        assert 0 <= p["accepted"] <= p["verified"] <= p["drafted"]
        if arm == "none":
            assert p["drafted"] == 0
        if arm == "k2":
            assert p["verified"] == p["drafted"] > 0
        assert p["step_count"] > 0 and p["step_ms"] > 0
        parts = p["step_draft_ms"] + p["step_verifier_ms"] + p["step_target_ms"]
        assert 0 < parts <= p["step_ms"] + 1e-6
    assert any(p["on_frontier"] for p in document["points"])
    assert document["goals"]["code"]["ad8"]["concurrencies"] == 2
    assert set(document["goals"]["code"]) == {"av8", "ad8"}
    assert "av_estimator_slope" in document["config"]["server_metrics"]
    with (out / "points.csv").open() as f:
        assert len(list(csv.DictReader(f))) == 8
    assert (out / "frontier_code.png").stat().st_size > 1000
    summary = (out / "summary.txt").read_text()
    assert "on the frontier" in summary and "per step (server metrics)" in summary
