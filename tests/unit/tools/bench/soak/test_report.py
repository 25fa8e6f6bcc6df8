"""avspec.tools.bench.soak.report: the soak.json document, the verdict, summary.txt, memory.png."""

from __future__ import annotations

import json
import os
from pathlib import Path

from avspec.tools.bench.soak import memory
from avspec.tools.bench.soak.load import Tally
from avspec.tools.bench.soak.memory import MemorySampler
from avspec.tools.bench.soak.mix import PROTOCOLS
from avspec.tools.bench.soak.report import build_result, summary_text, verdict, write_outputs

RUN = {"elapsed_s": 30.0, "stuck_loops": 0, "live_after_load": {}, "live_error": None}


def _result(**changes) -> dict:
    result = {
        "config": {"concurrency": 4, "warmup_s": 10.0, "max_tokens": [16, 64]},
        "counts": {"ok": 10, "failed": 0, "cancelled": 1},
        "by_protocol": {p: {"ok": 1, "failed": 0, "cancelled": 0} for p in PROTOCOLS},
        "errors": [],
        "elapsed_s": 30.0,
        "stuck_loops": 0,
        "live_after_load": {"av_live_sequences": 0.0},
        "samples": [{"t": 0.0, "rss_mib": {"tritonserver": 10.0}, "shm_bytes": 0,
                     "server_shm_bytes": 0}],
        "memory": {
            name: {"first_after_warmup_mib": 10.0, "last_mib": 10.5, "peak_mib": 11.0,
                   "growth": 0.05, "plateau": None}
            for name in ("tritonserver", "draft")
        },
        "restarts": [],
        "shm": None,
    }  # fmt: skip
    result.update(changes)
    return result


def test_verdict_and_summary():
    assert verdict(_result(), max_growth=0.10) == []
    assert "PASS" in summary_text({**_result(), "failures": []})
    grown = _result()
    grown["memory"]["tritonserver"]["growth"] = 0.10
    bad = _result(
        counts={"ok": 1, "failed": 2, "cancelled": 0},
        errors=["grpc: boom", "http: HTTP 500"],
        restarts=[{"t": 3.0, "process": "target", "old_pid": 1, "new_pid": 2}],
        live_after_load={"av_live_sequences": 2.0},
        shm={"server_regions_left": ["r1"]},
        live_error="metrics unreachable after the load: refused",
        memory=grown["memory"],
    )
    reasons = verdict(bad, max_growth=0.10)
    assert len(reasons) == 6
    assert any("2 requests failed" in r for r in reasons)
    assert any("tritonserver grew" in r for r in reasons)
    assert any("target restarted" in r for r in reasons)


def test_verdict_on_stuck_loops_and_a_server_without_stubs():
    memory_only_server = {"tritonserver": _result()["memory"]["tritonserver"]}
    reasons = verdict(_result(stuck_loops=2, memory=memory_only_server), max_growth=0.10)
    assert reasons == [
        "2 client loops still running after the deadline",
        "no Python-backend stub found (is --model-repository the served one?)",
    ]


def test_summary_text_lines():
    shm = {
        "before_bytes": 2**20,
        "after_bytes": 3 * 2**20,
        "returned_to_baseline": False,
        "server_regions": ["a", "b"],
        "server_regions_left": ["a"],
        "other_new_files": ["x"],
    }
    result = _result(errors=["grpc: boom"], shm=shm, failures=["1 requests failed"])
    result["memory"]["draft"]["plateau"] = {
        "first_third_growth": 0.2,
        "last_third_growth": 0.001,
        "plateaued": True,
    }
    lines = summary_text(result).splitlines()
    assert lines[0] == "soak: 4 loops, 30 s (warm-up 10 s), max_tokens [16, 64]"
    assert lines[1] == (
        "requests: 10 ok, 0 failed, 1 cancelled (0.4/s); grpc 1/0/0, http 1/0/0, "
        "http_stream 1/0/0 (ok/failed/cancelled)"
    )
    assert lines[2] == "  error: grpc: boom"
    assert lines[3].split() == "RSS MiB warm last peak growth 1st 3rd last 3rd plateau".split()
    assert lines[4].split() == ["tritonserver", "10", "10", "11", "+5.0%", "-", "-", "-"]
    assert lines[5].split() == ["draft", "10", "10", "11", "+5.0%", "+20.0%", "+0.1%", "yes"]
    assert lines[6].startswith("/dev/shm during the run: 0.0 MiB at start")
    assert lines[7] == (
        "/dev/shm before 1.0 MiB, after stop 3.0 MiB (baseline NOT regained); "
        "server regions left: 1 of 2; other new files: 1"
    )
    assert lines[8] == "live sequences after the load: {'av_live_sequences': 0.0}"
    assert lines[9] == "FAIL: 1 requests failed"


def test_summary_without_memory_or_samples():
    result = _result(memory={}, samples=[], live_after_load={}, failures=[])
    lines = summary_text(result).splitlines()
    assert lines[2:] == ["memory: not sampled (no --server-pid)", "PASS"]


def test_build_result_without_a_sampler():
    tally = Tally()
    tally.add("grpc", "ok")
    tally.add("http", "failed", "HTTP 500: x")
    config = {"concurrency": 1, "warmup_s": 0.0, "max_tokens": [1, 2]}
    result = build_result(config, tally, RUN, None, None, warmup_s=0.0, max_growth=0.1)
    assert list(result) == [
        "config", "counts", "by_protocol", "errors", "elapsed_s", "stuck_loops",
        "live_after_load", "live_error", "samples", "memory", "restarts", "shm", "failures",
    ]  # fmt: skip
    assert result["counts"] == {"ok": 1, "failed": 1, "cancelled": 0}
    assert result["errors"] == ["http: HTTP 500: x"]
    assert result["samples"] == [] and result["memory"] == {} and result["restarts"] == []
    assert result["failures"] == ["1 requests failed"]


def test_build_result_and_outputs_with_a_sampler(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(memory, "find_stubs", lambda server_pid, repository: {})
    sampler = MemorySampler(os.getpid(), tmp_path, lambda: 0)
    for _ in range(3):
        sampler.sample()
    config = {"concurrency": 1, "warmup_s": 0.0, "max_tokens": [1, 2]}
    result = build_result(config, Tally(), RUN, sampler, None, warmup_s=0.0, max_growth=100.0)
    assert set(result["memory"]) == {"tritonserver"} and len(result["samples"]) == 3
    assert result["failures"] == [
        "no Python-backend stub found (is --model-repository the served one?)"
    ]
    text = write_outputs(tmp_path / "out", result)
    assert json.loads((tmp_path / "out" / "soak.json").read_text()) == json.loads(
        json.dumps(result)
    )
    assert (tmp_path / "out" / "summary.txt").read_text() == text
    assert (tmp_path / "out" / "memory.png").stat().st_size > 1000


def test_write_outputs_without_samples_draws_no_plot(tmp_path: Path):
    write_outputs(tmp_path, _result(samples=[], failures=[]))
    assert (tmp_path / "soak.json").exists() and not (tmp_path / "memory.png").exists()
