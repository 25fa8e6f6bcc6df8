"""avspec.tools.bench.soak.memory: /proc parsing, /dev/shm accounting, finding and sampling the
server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from avspec.serving.host.supervisor import Stub
from avspec.tools.bench.soak import memory
from avspec.tools.bench.soak.memory import (
    MemorySampler,
    cmdline,
    find_tritonserver,
    parse_vmrss_kib,
    repository_from_cmdline,
    rss_mib,
    shm_after_stop,
    shm_usage,
)


def test_parse_vmrss_kib():
    status = "Name:\ttritonserver\nVmPeak:\t  999 kB\nVmRSS:\t  884736 kB\nThreads:\t12\n"
    assert parse_vmrss_kib(status) == 884736
    assert parse_vmrss_kib("Name:\tzombie\nState:\tZ (zombie)\n") is None


def test_rss_and_cmdline_of_this_process_and_of_a_gone_one():
    assert rss_mib(os.getpid()) > 1
    assert Path(cmdline(os.getpid())[0]).name.startswith("python")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert rss_mib(gone.pid) is None
    with pytest.raises(OSError):
        cmdline(gone.pid)


def test_repository_from_cmdline():
    argv = ["/x/tritonserver", "--model-repository=/tmp/repo", "--http-port=1"]
    assert repository_from_cmdline(argv) == Path("/tmp/repo")
    assert repository_from_cmdline(["tritonserver", "--model-store", "/r"]) == Path("/r")
    assert repository_from_cmdline(["tritonserver", "--http-port=1"]) is None
    assert repository_from_cmdline(["tritonserver", "--model-repository"]) is None


def test_shm_usage_and_after_stop(tmp_path: Path):
    (tmp_path / "old").write_bytes(b"\0" * 10)
    before = shm_usage(tmp_path)
    (tmp_path / "ours").write_bytes(b"\0" * 100)
    (tmp_path / "theirs").write_bytes(b"\0" * 7)
    (tmp_path / "dir").mkdir()
    assert shm_usage(tmp_path) == {"old": 10, "ours": 100, "theirs": 7}
    shm = shm_after_stop(before, {"ours"}, timeout_s=0, directory=tmp_path)
    assert shm["server_regions_left"] == ["ours"] and shm["other_new_files"] == ["theirs"]
    assert shm["before_bytes"] == 10 and shm["after_bytes"] == 117
    assert not shm["returned_to_baseline"]
    (tmp_path / "ours").unlink()
    (tmp_path / "theirs").unlink()
    shm = shm_after_stop(before, {"ours"}, timeout_s=0, directory=tmp_path)
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
    deadline = time.monotonic() + 20
    while True:  # the interpreters take a moment to start and replace their command lines
        try:
            sampler = MemorySampler(find_tritonserver(launcher.pid), repository, lambda: 0)
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
        with pytest.raises(ValueError, match="no tritonserver descendant"):
            find_tritonserver(sleeper.pid)
    finally:
        sleeper.kill()
        sleeper.wait()


def test_sampler_records_a_stub_restart(monkeypatch, tmp_path: Path):
    pids = iter([os.getpid(), os.getppid()])

    def fake_find_stubs(server_pid, repository):
        pid = next(pids)
        return {"target": Stub(pid, 0, "target", "/r", tmp_path / "target/1/model.py")}

    monkeypatch.setattr(memory, "find_stubs", fake_find_stubs)
    sampler = MemorySampler(os.getpid(), tmp_path, lambda: 0)
    sampler.sample()
    sampler.sample()
    assert [r["process"] for r in sampler.restarts] == ["target"]
    assert set(sampler.series()) == {"tritonserver", "target"}


def test_sampler_thread_samples_until_stopped(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(memory, "find_stubs", lambda server_pid, repository: {})
    done = iter(range(1000))
    sampler = MemorySampler(os.getpid(), tmp_path, lambda: next(done), interval_s=0.01)
    sampler.start_thread()
    time.sleep(0.2)
    sampler.stop()
    count = len(sampler.samples)
    assert count >= 3 and [s["requests_done"] for s in sampler.samples] == list(range(count))
    times, values = sampler.series()["tritonserver"]
    assert times == sorted(times) and len(values) == count
    time.sleep(0.05)
    assert len(sampler.samples) == count  # the thread has ended
