"""client/soak.py without a server: the command line, soak.json's config, the exit status.

The library under it (avspec.tools.bench.soak) is tested in tests/unit/tools/bench/soak/.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script

from avspec.serving.host.server_process import free_port
from avspec.tools.bench.soak import load

soak = load_client_script("soak")


def test_parse_args(tmp_path: Path):
    args = soak.parse_args(["--out", str(tmp_path)])
    assert (args.concurrency, args.duration_s, args.warmup_s) == (64, 600.0, 60.0)
    assert args.token_range == (16, 64) and args.max_growth == 0.10
    bad_args = (
        ["--max-tokens", "64,16"],
        ["--max-tokens", "8"],
        ["--concurrency", "0"],
        ["--cancel-fraction", "1.5"],
    )
    for bad in bad_args:
        with pytest.raises(SystemExit):
            soak.parse_args(bad)


def test_config_is_every_option_with_max_tokens_as_a_pair(tmp_path: Path):
    args = soak.parse_args(["--out", str(tmp_path), "--max-tokens", "4,8"])
    config = soak._config(args)
    assert list(config) == [k for k in vars(args) if k != "token_range"]
    assert config["max_tokens"] == [4, 8] and config["out"] == str(tmp_path)
    json.dumps(config)


def test_main_without_prompts_exits_2(tmp_path: Path, capsys):
    assert soak.main(["--workload-dir", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert "no prompt of at most" in capsys.readouterr().err


def test_main_against_no_server_fails(tmp_path: Path, monkeypatch, capsys):
    """Every request fails, the metrics are unreachable: exit 1, soak.json and summary, no plot."""
    monkeypatch.setattr(load, "FAILURE_PAUSE_S", 0.0)
    (tmp_path / "w.jsonl").write_text('{"prompt": "hello"}\n')
    port = free_port()
    out = tmp_path / "out"
    rc = soak.main([
        "--grpc-url", f"127.0.0.1:{port}", "--http-url", f"http://127.0.0.1:{port}",
        "--metrics-url", f"http://127.0.0.1:{port}/metrics", "--concurrency", "2",
        "--duration-s", "0.5", "--workload-dir", str(tmp_path), "--out", str(out),
    ])  # fmt: skip
    assert rc == 1
    document = json.loads((out / "soak.json").read_text())
    assert document["counts"]["failed"] > 0 and document["counts"]["ok"] == 0
    assert document["config"]["max_tokens"] == [16, 64] and "token_range" not in document["config"]
    assert document["memory"] == {} and document["shm"] is None
    assert document["live_error"].startswith("metrics unreachable after the load")
    summary = (out / "summary.txt").read_text()
    assert "memory: not sampled (no --server-pid)" in summary
    assert summary.splitlines()[-1].startswith("FAIL: ")
    assert not (out / "memory.png").exists()
    assert capsys.readouterr().out == summary + f"wrote {out}\n"


def test_sampler_needs_the_repository(tmp_path: Path):
    """A tritonserver whose command line names no repository, and none given: SystemExit."""
    script = "open('/proc/self/comm', 'w').write('tritonserver'); import time; time.sleep(30)"
    server = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{server.pid}/comm").read_text().strip() != "tritonserver":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        args = soak.parse_args(["--out", str(tmp_path)])
        with pytest.raises(SystemExit, match="no --model-repository in tritonserver"):
            soak._sampler(server.pid, None, load.Tally(), args)
        assert soak._sampler(None, None, load.Tally(), args) is None
    finally:
        server.kill()
        server.wait()
