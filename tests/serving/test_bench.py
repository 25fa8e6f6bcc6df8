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


def test_a_sweep_hands_over_each_concurrency_as_it_completes(server, tmp_path: Path):
    """A long sweep writes its points as each (workload, concurrency) completes, so stopping
    it keeps what it measured: the hand-over after c = 1 holds c = 1's arms only."""
    bench = load_client_script("bench_serving")
    args = bench.parse_args([
        "--url", server.grpc_url, "--concurrency", "1,2", "--arms", "none,k2",
        "--workloads", "code", "--prompts", "2", "--max-tokens", "4", "--rounds", "1",
        "--requests-per-user", "1", "--min-requests", "2", "--warmup-requests", "0",
        "--out", str(tmp_path),
    ])  # fmt: skip
    arms = bench.take_arms(args)
    handed: list[list[tuple[int, str]]] = []
    client = bench.StreamClient(server.grpc_url, args)
    try:
        points = bench.sweep(
            client, args, arms, None,
            lambda so_far: handed.append(sorted((p["concurrency"], p["arm"]) for p in so_far)),
        )  # fmt: skip
    finally:
        client.close()
    assert handed == [[(1, "k2"), (1, "none")]]
    assert sorted((p["concurrency"], p["arm"]) for p in points) == [
        (1, "k2"), (1, "none"), (2, "k2"), (2, "none"),
    ]  # fmt: skip


def test_a_sweep_of_fixed_length_is_replayed_and_reported(server, tmp_path: Path):
    """--ignore-eos makes every answer max_tokens long; the session server's step log, cut by
    the points' windows, is replayed for every arm (client/replay_steps.py) and the budget's
    choices are reported (client/av_report.py)."""
    out = tmp_path / "sweep"
    rc = load_client_script("bench_serving").main([
        "--url", server.grpc_url, "--concurrency", "1,2", "--arms", "none,k1,k2,k4,k8,av8,ad8",
        "--workloads", "code", "--prompts", "2", "--max-tokens", "12", "--rounds", "1",
        "--requests-per-user", "1", "--min-requests", "2", "--warmup-requests", "0",
        "--ignore-eos", "--out", str(out),
    ])  # fmt: skip
    assert rc == 0
    points = json.loads((out / "points.json").read_text())["points"]
    assert all(p["output_tokens"] == 2 * 12 for p in points)  # no answer ended at EOS
    assert all(len(p["windows"]) == 1 for p in points)
    (out / "server").mkdir()
    (out / "server" / "step_log.jsonl").write_bytes(server.step_log.read_bytes())
    (out / "server" / "model_repository").symlink_to(server.repository)

    assert load_client_script("replay_steps").main([str(out)]) == 0
    rows = json.loads((out / "replay_host.json").read_text())["rows"]
    assert {(r["concurrency"], r["arm"]) for r in rows} == {
        (p["concurrency"], p["arm"]) for p in points
    }
    assert all(r["predicted"] > 0 and r["served"] > 0 for r in rows)
    for name in ("recorded_steps.jsonl.gz", "cost_tables.json", "estimator.json"):
        assert (out / name).is_file()

    gpu = tmp_path / "gpu"
    assert load_client_script("replay_steps").main([str(out), "--gpu", "--out", str(gpu)]) == 0
    modelled = json.loads((gpu / "points.json").read_text())
    assert modelled["modelled"] and "(modelled)" in (gpu / "summary.txt").read_text()
    assert (gpu / "frontier_sweep.png").stat().st_size > 1000

    report = tmp_path / "report"
    assert load_client_script("av_report").main([str(out), "--out", str(report)]) == 0
    budget = json.loads((report / "budget.json").read_text())["sweep"]["budget"]
    for arm in ("av8", "ad8"):
        for choice in budget[arm].values():
            assert 0 <= choice["accepted_per_row"] <= choice["verified_per_row"]
            assert choice["verified_per_row"] <= choice["drafted_per_row"] <= 8
    assert (report / "budget_sweep.png").stat().st_size > 1000
    assert "av8/k8" in (report / "goals.txt").read_text()
    assert "share of the phase at full batch" in (report / "goals_full_batch.txt").read_text()
    steady = json.loads((report / "budget.json").read_text())["sweep"]["full_batch"]
    assert steady and all(0.0 <= p["share"] <= 1.0 for p in steady)
