"""StageSupervisor against stand-in stubs: child processes of this test named like Triton's stub.

A Python script called `triton_python_backend_stub`, started with a stub's arguments (model.py
path, shared-memory region), is what the supervisor looks for: a child of the server pid (here,
this process) whose command line names a model of the repository. No tritonserver needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from avspec.serving.host import supervisor as supervisor_module
from avspec.serving.host.supervisor import StageHooks, StageSupervisor, find_stubs

MODELS = ("draft", "speculative", "verifier")


class FakeServer:
    """Starts stand-in stubs as children of this process; `reload` replaces one."""

    def __init__(self, tmp: Path) -> None:
        self.binary = tmp / "bin" / "triton_python_backend_stub"
        self.binary.parent.mkdir()
        self.binary.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
        self.binary.chmod(0o755)
        self.repository = tmp / "repo"
        self.shm = tmp / "shm"
        self.shm.mkdir()
        self.processes: dict[str, subprocess.Popen] = {}  # each model's current stand-in
        self.started: list[subprocess.Popen] = []  # every stand-in ever started
        self.reloads: list[str] = []
        self.fail_reloads = 0
        self.loaded = set(MODELS)  # what Triton would call loaded

    def spawn(self, model: str) -> None:
        """Start a model's stand-in, first killing its previous one (as Triton's unload does)."""
        previous = self.processes.get(model)
        if previous is not None and previous.poll() is None:
            previous.kill()
            previous.wait()
        region = f"avspec1_{model}_{len(list(self.shm.iterdir()))}"
        (self.shm / region).write_bytes(b"\0" * 16)
        model_py = self.repository / model / "1" / "model.py"
        model_py.parent.mkdir(parents=True, exist_ok=True)
        self.processes[model] = subprocess.Popen([str(self.binary), str(model_py), region, "1"])
        self.started.append(self.processes[model])

    def reload(self, model: str) -> None:
        self.reloads.append(model)
        if self.fail_reloads:
            self.fail_reloads -= 1
            raise RuntimeError("load failed")
        self.spawn(model)

    def kill(self, model: str) -> str:
        """SIGKILL a model's stub (reaped, as tritonserver would); return its region name."""
        process = self.processes[model]
        region = process.args[2]
        process.kill()
        process.wait()
        return region

    def close(self) -> None:
        """Kill and reap every stand-in this server ever started."""
        for process in self.started:
            process.kill()
            process.wait()


@pytest.fixture
def fake(tmp_path: Path):
    server = FakeServer(tmp_path)
    for model in MODELS:
        server.spawn(model)
    time.sleep(0.2)  # let the interpreter replace the fork's command line
    yield server
    server.close()


def supervisor(fake: FakeServer, dead: list[str]) -> StageSupervisor:
    return StageSupervisor(
        server_pid=os.getpid(),
        repository=fake.repository,
        models=MODELS,
        hooks=StageHooks(
            reload=fake.reload,
            is_loaded=lambda model: model in fake.loaded,
            on_dead=dead.append,
        ),
        shm_dir=fake.shm,
    )


def test_find_stubs_maps_each_model_to_its_stub(fake: FakeServer) -> None:
    stubs = find_stubs(os.getpid(), fake.repository)
    assert sorted(stubs) == sorted(MODELS)
    assert stubs["draft"].pid == fake.processes["draft"].pid
    assert stubs["draft"].shm_region == fake.processes["draft"].args[2]
    assert find_stubs(os.getpid(), fake.repository / "elsewhere") == {}


def _by_pid(path: Path) -> tuple:
    return (path.name.isdigit(), len(path.name), path.name)


@pytest.mark.parametrize("reverse", [False, True])
def test_find_stubs_takes_the_newest_while_an_old_stub_exits(
    fake: FakeServer, monkeypatch: pytest.MonkeyPatch, reverse: bool
) -> None:
    """Just after a reload Triton's old stub may still be exiting beside the new one: a CI run's
    soak read the old one first, then the new one, and called it a restart. Whatever order
    /proc lists them in, the newest is the model's stub."""
    old = fake.processes["verifier"]
    time.sleep(0.05)  # start times count in clock ticks (10 ms)
    new = subprocess.Popen([str(fake.binary), *old.args[1:]])
    fake.started.append(new)
    time.sleep(0.2)  # let the interpreter replace the fork's command line

    class ListedInOrder(type(Path())):
        def iterdir(self):
            entries = sorted(super().iterdir(), key=_by_pid)
            return iter(reversed(entries) if reverse else entries)

    monkeypatch.setattr(supervisor_module, "Path", ListedInOrder)
    assert find_stubs(os.getpid(), fake.repository)["verifier"].pid == new.pid


def test_start_refuses_a_model_without_stub(fake: FakeServer) -> None:
    fake.kill("verifier")
    with pytest.raises(RuntimeError, match="verifier"):
        supervisor(fake, []).start()


def test_dead_stub_is_reported_reloaded_and_its_region_removed(fake: FakeServer) -> None:
    dead: list[str] = []
    sup = supervisor(fake, dead)
    sup._stubs = find_stubs(os.getpid(), fake.repository)
    assert sup.check() == [] and sup.ready()
    region = fake.kill("verifier")
    assert sup.check() == ["verifier"]
    assert dead == ["verifier"] and fake.reloads == ["verifier"]
    assert sup.ready() and sup.restarts["verifier"] == 1
    assert not (fake.shm / region).exists()
    assert sup.check() == []  # the new stub is watched, nothing more to do


def test_failed_reload_keeps_readiness_false_until_a_retry_succeeds(fake: FakeServer) -> None:
    sup = supervisor(fake, [])
    sup._stubs = find_stubs(os.getpid(), fake.repository)
    fake.fail_reloads = 1
    fake.kill("draft")
    sup.check()
    assert not sup.ready() and sup.restarts["draft"] == 0
    sup.check()
    assert sup.ready() and sup.restarts["draft"] == 1
    assert fake.reloads == ["draft", "draft"]


def test_background_thread_recovers_without_help(fake: FakeServer) -> None:
    sup = supervisor(fake, [])
    sup.interval_s = 0.05
    sup.start()
    try:
        fake.kill("speculative")
        deadline = time.monotonic() + 5
        while sup.restarts["speculative"] == 0:
            assert time.monotonic() < deadline, "supervisor did not reload in time"
            time.sleep(0.02)
        assert sup.ready()
    finally:
        sup.stop()


def test_an_operator_unload_is_not_a_death_and_the_next_stub_is_adopted(fake: FakeServer) -> None:
    dead: list[str] = []
    sup = supervisor(fake, dead)
    sup._stubs = find_stubs(os.getpid(), fake.repository)
    fake.loaded.discard("verifier")  # unloaded through the repository API
    region = fake.kill("verifier")
    assert sup.check() == [] and sup.ready() and dead == [] and fake.reloads == []
    fake.spawn("verifier")  # loaded again by the operator
    fake.loaded.add("verifier")
    time.sleep(0.2)
    assert sup.check() == []
    assert sup._stubs["verifier"].pid == fake.processes["verifier"].pid
    assert not (fake.shm / region).exists()
    fake.kill("verifier")  # and a death after that is noticed
    assert sup.check() == ["verifier"] and dead == ["verifier"]


def test_followers_of_a_dead_model_are_reloaded_with_it(fake: FakeServer) -> None:
    dead: list[str] = []
    sup = supervisor(fake, dead)
    sup.followers = {"speculative": ["draft", "verifier"]}
    sup._stubs = find_stubs(os.getpid(), fake.repository)
    old = {m: s.pid for m, s in sup._stubs.items()}
    fake.kill("speculative")
    assert sup.check() == ["speculative"]
    assert dead == ["speculative"]  # followers are reloaded, not reported dead
    assert fake.reloads == ["speculative", "draft", "verifier"]
    assert all(sup._stubs[m].pid != old[m] for m in MODELS) and sup.ready()
    assert sup.restarts == {"draft": 1, "speculative": 1, "verifier": 1}
    replaced = [p for p in fake.started if p.pid in old.values()]
    assert len(replaced) == 3 and all(p.poll() is not None for p in replaced)  # none left running
