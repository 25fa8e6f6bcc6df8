"""client/soak.py without a server: request mix, growth and plateau, process discovery, verdict."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script

from avspec.serving.supervisor import Stub

soak = load_client_script("soak")


def _times(n: int, step: float = 5.0) -> list[float]:
    return [i * step for i in range(n)]


def test_growth_after_warmup_uses_first_and_last_sample_after_warmup():
    times = _times(6)  # 0 5 10 15 20 25
    values = [100.0, 500.0, 200.0, 210.0, 205.0, 220.0]
    assert soak.growth_after_warmup(times, values, warmup_s=10) == pytest.approx(0.10)
    assert soak.growth_after_warmup(times, values, warmup_s=0) == pytest.approx(1.20)
    assert soak.growth_after_warmup(times, values, warmup_s=25) is None  # one sample left


def test_plateau_flat_after_early_growth():
    """Grows 864 -> 1086 over the first third after warm-up, then flat: plateaued."""
    times = _times(31)
    values = [864 + min(t, 50) * 222 / 50 for t in times]
    p = soak.plateau(times, values, warmup_s=0)
    assert p["first_third_growth"] > 0.1
    assert abs(p["last_third_growth"]) < 1e-9
    assert p["plateaued"] is True


def test_plateau_linear_leak_is_not_plateaued():
    times = _times(31)
    values = [800 + 2.0 * t for t in times]  # 2 MiB per second, steady
    p = soak.plateau(times, values, warmup_s=30)
    assert p["last_third_growth"] > 0.25 * p["first_third_growth"] > 0
    assert p["plateaued"] is False


def test_plateau_jitter_within_tolerance_is_plateaued():
    rng = random.Random(0)
    times = _times(40)
    values = [1000 + rng.uniform(-3, 3) for _ in times]
    assert soak.plateau(times, values, warmup_s=0)["plateaued"] is True


def test_plateau_needs_two_samples_per_third():
    assert soak.plateau(_times(3), [1.0, 2.0, 3.0], warmup_s=0) is None
    assert soak.plateau(_times(5), [1.0] * 5, warmup_s=20) is None


def test_memory_report_per_process():
    series = {"tritonserver": (_times(4), [10.0, 20.0, 20.0, 22.0]), "draft": ([0.0], [5.0])}
    report = soak.memory_report(series, warmup_s=5)
    assert report["tritonserver"]["first_after_warmup_mib"] == 20.0
    assert report["tritonserver"]["growth"] == pytest.approx(0.10)
    assert report["tritonserver"]["peak_mib"] == 22.0
    assert report["draft"]["growth"] is None and report["draft"]["first_after_warmup_mib"] is None


def test_parse_vmrss_kib():
    status = "Name:\ttritonserver\nVmPeak:\t  999 kB\nVmRSS:\t  884736 kB\nThreads:\t12\n"
    assert soak.parse_vmrss_kib(status) == 884736
    assert soak.parse_vmrss_kib("Name:\tzombie\nState:\tZ (zombie)\n") is None


def test_repository_from_cmdline():
    argv = ["/x/tritonserver", "--model-repository=/tmp/repo", "--http-port=1"]
    assert soak.repository_from_cmdline(argv) == Path("/tmp/repo")
    assert soak.repository_from_cmdline(["tritonserver", "--model-store", "/r"]) == Path("/r")
    assert soak.repository_from_cmdline(["tritonserver", "--http-port=1"]) is None


def test_draw_request_mix():
    mix = soak.Mix(["a", "b"], 16, 64, cancel_fraction=0.5)
    rng = random.Random(1)
    specs = [soak.draw_request(rng, mix) for _ in range(2000)]
    assert {s.protocol for s in specs} == set(soak.PROTOCOLS)
    assert {s.temperature for s in specs} == {0.0, 0.7, 1.0}
    assert {s.num_draft_tokens for s in specs} == {0, 4, None}
    assert min(s.max_tokens for s in specs) == 16 and max(s.max_tokens for s in specs) == 64
    cancelled = [s for s in specs if s.cancel_after is not None]
    assert cancelled and {s.protocol for s in cancelled} == set(soak.STREAMING)
    assert {s.cancel_after for s in cancelled} == {1, 2, 3}
    grpc_share = sum(s.protocol == "grpc" for s in specs) / len(specs)
    assert 0.45 < grpc_share < 0.55


def test_load_prompts_skips_what_does_not_fit(tmp_path: Path):
    lines = [json.dumps({"prompt": p}) for p in ("abc", "x" * 10, "é" * 4)]  # é: 2 bytes
    (tmp_path / "w.jsonl").write_text("\n".join(lines) + "\n\n")
    (tmp_path / "other.txt").write_text("ignored")
    assert soak.load_prompts(tmp_path, 8) == ["abc", "é" * 4]


def test_shm_usage_and_after_stop(tmp_path: Path):
    (tmp_path / "old").write_bytes(b"\0" * 10)
    before = soak.shm_usage(tmp_path)
    (tmp_path / "ours").write_bytes(b"\0" * 100)
    (tmp_path / "theirs").write_bytes(b"\0" * 7)
    (tmp_path / "dir").mkdir()
    assert soak.shm_usage(tmp_path) == {"old": 10, "ours": 100, "theirs": 7}
    shm = soak.shm_after_stop(before, {"ours"}, timeout_s=0, directory=tmp_path)
    assert shm["server_regions_left"] == ["ours"] and shm["other_new_files"] == ["theirs"]
    assert shm["before_bytes"] == 10 and shm["after_bytes"] == 117
    assert not shm["returned_to_baseline"]
    (tmp_path / "ours").unlink()
    (tmp_path / "theirs").unlink()
    shm = soak.shm_after_stop(before, {"ours"}, timeout_s=0, directory=tmp_path)
    assert shm["returned_to_baseline"] and not shm["server_regions_left"]


SERVER_SCRIPT = """
import subprocess, sys, time
with open("/proc/self/comm", "w") as f:
    f.write("tritonserver")
stub, repository = sys.argv[1], sys.argv[2]
children = [
    subprocess.Popen([stub, f"{repository}/{m}/1/model.py", f"/region_{m}", "1"])
    for m in ("draft", "verifier")
]
time.sleep(60)
"""


@pytest.fixture
def fake_launcher(tmp_path: Path):
    """launcher (python) -> "tritonserver" (comm renamed) -> two stand-in stubs, own session."""
    stub = tmp_path / "bin" / "triton_python_backend_stub"
    stub.parent.mkdir()
    stub.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(60)\n")
    stub.chmod(0o755)
    repository = tmp_path / "repo"
    (tmp_path / "server.py").write_text(SERVER_SCRIPT)
    launcher = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
         sys.executable, str(tmp_path / "server.py"), str(stub), str(repository)],
        start_new_session=True,
    )  # fmt: skip
    yield launcher, repository
    os.killpg(launcher.pid, signal.SIGKILL)
    launcher.wait()


def test_sampler_finds_tritonserver_and_stubs(fake_launcher):
    launcher, repository = fake_launcher
    tally = soak.Tally()
    deadline = time.monotonic() + 20
    while True:  # the interpreters take a moment to start and replace their command lines
        try:
            sampler = soak.MemorySampler(soak.find_tritonserver(launcher.pid), repository, tally)
            record = sampler.sample()
        except ValueError:
            record = {"rss_mib": {}}
        if len(record["rss_mib"]) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert set(record["rss_mib"]) == {"tritonserver", "draft", "verifier"}
    assert all(v > 1 for v in record["rss_mib"].values())
    assert sampler.server_pid != launcher.pid
    assert sampler.regions == {"region_draft", "region_verifier"}
    assert record["shm_bytes"] >= 0 and record["requests_done"] == 0
    assert not sampler.restarts


def test_find_tritonserver_without_one():
    # not os.getpid(): in a full test session the shared server is a child of pytest
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with pytest.raises(ValueError):
            soak.find_tritonserver(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sampler_records_a_stub_restart(monkeypatch, tmp_path: Path):
    pids = iter([os.getpid(), os.getppid()])

    def fake_find_stubs(server_pid, repository):
        pid = next(pids)
        return {"target": Stub(pid, 0, "target", "/r", tmp_path / "target/1/model.py")}

    monkeypatch.setattr(soak, "find_stubs", fake_find_stubs)
    sampler = soak.MemorySampler(os.getpid(), tmp_path, soak.Tally())
    sampler.sample()
    sampler.sample()
    assert [r["process"] for r in sampler.restarts] == ["target"]
    assert set(sampler.series()) == {"tritonserver", "target"}


def test_tally_counts_and_keeps_errors():
    tally = soak.Tally()
    tally.add("grpc", "ok")
    tally.add("http", "cancelled")
    tally.add("http_stream", "failed", "HTTP 503: busy")
    assert (tally.total("ok"), tally.total("failed"), tally.total("cancelled")) == (1, 1, 1)
    assert tally.done() == 3 and tally.errors == ["http_stream: HTTP 503: busy"]
    assert tally.by_protocol()["http"] == {"ok": 0, "failed": 0, "cancelled": 1}


def _result(**changes) -> dict:
    result = {
        "config": {"concurrency": 4, "warmup_s": 10.0, "max_tokens": [16, 64]},
        "counts": {"ok": 10, "failed": 0, "cancelled": 1},
        "by_protocol": {p: {"ok": 1, "failed": 0, "cancelled": 0} for p in soak.PROTOCOLS},
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
    assert soak.verdict(_result(), max_growth=0.10) == []
    assert "PASS" in soak.summary_text({**_result(), "failures": []})
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
    reasons = soak.verdict(bad, max_growth=0.10)
    assert len(reasons) == 6
    assert any("2 requests failed" in r for r in reasons)
    assert any("tritonserver grew" in r for r in reasons)
    assert any("target restarted" in r for r in reasons)


def test_parse_args(tmp_path: Path):
    args = soak.parse_args(["--out", str(tmp_path)])
    assert (args.concurrency, args.duration_s, args.warmup_s) == (64, 600.0, 60.0)
    assert args.token_range == (16, 64) and args.max_growth == 0.10
    for bad in (["--max-tokens", "64,16"], ["--max-tokens", "8"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)
