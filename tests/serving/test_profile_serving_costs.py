"""client/profile_serving_costs.py against the session's real server: a step-cost file."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.client_scripts import load_profile_serving_costs

from avspec.av.cost_file import load_step_cost


def test_cost_tables_from_triton_metrics(server, tmp_path: Path):
    """Concurrency 1 and 3, K 0 and 4, 6 tokens: 4 points, read back by the verifier's loader."""
    out = tmp_path / "costs.json"
    rc = load_profile_serving_costs().main([
        "--http-url", server.http_url, "--metrics-url", server.metrics_url,
        "--concurrency", "1,3", "--draft-tokens", "0,4", "--max-tokens", "6",
        "--tokenizer", str(server.target_dir), "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    document = json.loads(out.read_text())
    points = document["measured"]["points"]
    assert [(p["concurrency"], p["k"]) for p in points] == [(1, 0), (3, 0), (1, 4), (3, 4)]
    for p in points:
        assert p["steps"] >= 1 and p["draft_ms"] > 0 and p["target_ms"] > 0
        # the step ensemble's own time covers both models' compute
        assert p["step_ms"] >= p["draft_ms"] + p["target_ms"] - 1e-6
        assert p["overhead_ms"] == p["step_ms"] - p["draft_ms"] - p["target_ms"]
        assert 1 <= p["sequences_per_step"] <= p["concurrency"]
        # every draft is verified: at most sequences * (1 + K) decode tokens, plus the prompts
        prefill = p["prompt_tokens"] / p["steps"]
        assert p["sequences_per_step"] + prefill <= p["target_tokens_per_step"] + 1e-9
        assert (
            p["target_tokens_per_step"] <= p["sequences_per_step"] * (1 + p["k"]) + prefill + 1e-9
        )
        assert p["prompt_tokens"] <= 16 * p["concurrency"]
    assert max(p["target_tokens_per_step"] for p in points if p["k"] == 4) > 3
    cost = load_step_cost(out)
    assert len(cost.draft_pass.sizes) >= 1 and len(cost.verify.sizes) >= 2
    assert cost.overhead_ms >= 0
    assert document["measured"]["max_draft_tokens"] == 4
    assert len(document["measured"]["check"]["points"]) == 4
