"""client/soak.py, short: 16 client loops for 20 s against the session's server.

No growth threshold here (20 s says nothing about a plateau); `make soak` runs the real one.
"""

from __future__ import annotations

import json
from pathlib import Path

from helpers.client_scripts import load_client_script
from helpers.server import MAX_LENGTH


def _python_models(repository: Path) -> set[str]:
    """The models served by a Python-backend stub (the ensemble has none)."""
    return {
        config.parent.name
        for config in repository.glob("*/config.pbtxt")
        if 'backend: "python"' in config.read_text()
    }


def test_soak_short(server, tmp_path: Path):
    out = tmp_path / "soak"
    rc = load_client_script("soak").main([
        "--grpc-url", server.grpc_url, "--http-url", server.http_url,
        "--metrics-url", server.metrics_url, "--server-pid", str(server.process.pid),
        "--model-repository", str(server.model_repository),
        "--concurrency", "16", "--duration-s", "20", "--warmup-s", "5", "--sample-s", "1",
        "--max-context", str(MAX_LENGTH), "--cancel-fraction", "0.1",
        "--max-growth", "1000", "--request-timeout", "60", "--out", str(out),
    ])  # fmt: skip
    document = json.loads((out / "soak.json").read_text())
    counts = document["counts"]
    assert counts["failed"] == 0, document["errors"][:5]
    assert counts["ok"] > 16 and counts["cancelled"] > 0, counts
    assert all(v["ok"] > 0 for v in document["by_protocol"].values()), document["by_protocol"]
    assert rc == 0, document["failures"]
    assert document["live_after_load"] and not any(document["live_after_load"].values())
    expected = {"tritonserver", *_python_models(server.model_repository)}
    assert len(expected) == 5
    samples = document["samples"]
    assert len(samples) >= 10
    assert all(set(s["rss_mib"]) == expected for s in samples), samples[0]
    assert all(s["shm_bytes"] >= 0 for s in samples)
    assert set(document["memory"]) == expected
    assert all(m["growth"] is not None for m in document["memory"].values())
    assert (out / "memory.png").stat().st_size > 1000
    assert "PASS" in (out / "summary.txt").read_text()
