"""Stage health: notice a dead Python-backend stub and reload its model.

Triton 2.51 does not restart a Python-backend stub killed from outside (OOM killer, `kill -9`):
the model keeps answering ready while every request fails with "Stub process is not healthy",
and an in-flight request of a decoupled model waits forever (seen on 2.51). One stub
process runs per model instance, a child of tritonserver whose command line names the model's
`model.py`, its shared-memory region and its instance (`verifier_0_0`).

`StageSupervisor` polls those children (every `interval_s`, /proc only, no request to the
server). When a model it saw running has lost its stub, it:
1. turns `ready()` False, so the public readiness endpoint answers 503 until recovery;
2. calls `on_dead(model)` (the launcher's front closes the inference streams that would hang);
3. reloads the model with unload + load through the repository API (a plain load of an
   unchanged model is a no-op in 2.51, seen here), which also reloads the ensemble over it;
4. removes the dead stub's shared-memory region, which nobody else frees while the server runs;
5. reloads the model's `followers` too: stages whose state belongs to the dead model's requests
   (when the entry model dies, its scheduler and every sequence id it handed out die with it;
   the KV caches of `draft` and `target` would hold those sequences until their idle timeout);
6. turns `ready()` True again once every model it reloads has a live stub.
A model whose reload fails is retried at the next poll; readiness stays False meanwhile. A stub
that exits because an operator unloaded its model is not a death: Triton no longer calls that
model loaded, so the supervisor leaves it alone and adopts the stub of a later load.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

STUB_NAME = "triton_python_backend_stub"


@dataclass(frozen=True)
class Stub:
    """One Python-backend stub process: identity (pid + start time) and what it serves."""

    pid: int
    start_time: int  # clock ticks after boot (/proc/<pid>/stat field 22): guards pid reuse
    model: str
    shm_region: str
    model_file: Path


def proc_stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name, or None if the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()  # the name may hold spaces and parentheses


def _alive(stub: Stub) -> bool:
    fields = proc_stat_fields(stub.pid)
    if fields is None or fields[0] in ("Z", "X"):  # state: zombie or dead
        return False
    return int(fields[19]) == stub.start_time


def find_stubs(server_pid: int, repository: Path) -> dict[str, Stub]:
    """The live stubs that `server_pid` started for models of `repository`, by model name.

    Just after a reload the old stub may still be exiting beside the new one: the newest
    (latest start time) is the model's stub.
    """
    repository = repository.resolve()
    stubs: dict[str, Stub] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        fields = proc_stat_fields(pid)
        if fields is None or int(fields[1]) != server_pid or fields[0] in ("Z", "X"):
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        stub = _parse_stub(pid, int(fields[19]), [a.decode(errors="replace") for a in argv])
        if stub is None or not stub.model_file.resolve().is_relative_to(repository):
            continue
        if stub.model not in stubs or stub.start_time > stubs[stub.model].start_time:
            stubs[stub.model] = stub
    return stubs


def _parse_stub(pid: int, start_time: int, argv: list[str]) -> Stub | None:
    """A Stub from a stub's argv (binary, model.py, shm region, ...), None for anything else.

    The binary is found by name rather than as argv[0], so an interpreter-run stand-in
    (`python .../triton_python_backend_stub ...`, the tests) parses the same way.
    """
    names = [Path(arg).name for arg in argv]
    if STUB_NAME not in names:
        return None
    at = names.index(STUB_NAME)
    if len(argv) < at + 3:
        return None
    model = Path(argv[at + 1]).parent.parent.name  # <repository>/<model>/<version>/model.py
    return Stub(pid, start_time, model, argv[at + 2], Path(argv[at + 1]))


def _no_one_told(model: str) -> None:
    """The default `on_dead`: nobody to tell."""


@dataclass(frozen=True)
class StageHooks:
    """What the supervisor asks of the server: `reload(model)` (unload + load), `is_loaded(model)`
    (Triton calls it loaded), and `on_dead(model)`, told when a model's stub died."""

    reload: Callable[[str], None]
    is_loaded: Callable[[str], bool]
    on_dead: Callable[[str], None] = _no_one_told


class StageSupervisor:
    """Polls the stubs of `models` and reloads a model whose stub died (module docstring)."""

    def __init__(
        self,
        server_pid: int,
        repository: Path,
        models: Iterable[str],
        hooks: StageHooks,
        followers: Mapping[str, Iterable[str]] | None = None,
        interval_s: float = 0.5,
        shm_dir: Path = Path("/dev/shm"),
    ) -> None:
        self.server_pid = server_pid
        self.repository = Path(repository)
        self.models = sorted(models)
        self.reload = hooks.reload
        self.is_loaded = hooks.is_loaded
        self.on_dead = hooks.on_dead
        self.followers = {model: list(after) for model, after in (followers or {}).items()}
        self.interval_s = interval_s
        self.shm_dir = shm_dir
        self.restarts: dict[str, int] = dict.fromkeys(self.models, 0)
        self._stubs: dict[str, Stub] = {}
        self._reloading: set[str] = set()
        self._regions: list[str] = []  # shared-memory regions of dead stubs, freed on recovery
        self._healthy = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def ready(self) -> bool:
        """False from the moment a dead stub is seen until its model is reloaded."""
        return self._healthy

    def start(self) -> StageSupervisor:
        """Record the running stubs (every model must have one) and start polling."""
        self._stubs = find_stubs(self.server_pid, self.repository)
        missing = [m for m in self.models if m not in self._stubs]
        if missing:
            raise RuntimeError(f"no running stub for model(s): {', '.join(missing)}")
        self._thread = threading.Thread(target=self._loop, name="avspec-supervisor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def check(self) -> list[str]:
        """One poll: reload the models whose stub died; return them.

        A model without a live stub is reloaded only while Triton still calls it loaded (the
        symptom of a killed stub) or while an earlier reload of ours is unfinished; a model an
        operator unloaded is left alone, and a stub that appears for a model is adopted.
        """
        scan: dict[str, Stub] | None = None
        dead = []
        for model in self.models:
            stub = self._stubs.get(model)
            if stub is not None and _alive(stub):
                continue
            scan = find_stubs(self.server_pid, self.repository) if scan is None else scan
            if model in scan and model not in self._reloading:
                self._adopt(model, scan[model])
                continue
            if stub is not None:
                self._stubs.pop(model)
                self._regions.append(stub.shm_region)
            if model in self._reloading or (stub is not None and self.is_loaded(model)):
                dead.append(model)
        self._healthy = not dead
        for model in dead:
            self._recover(model)
        self._healthy = not self._reloading
        return dead

    def _adopt(self, model: str, stub: Stub) -> None:
        self._stubs[model] = stub
        for region in self._regions:  # the dead stub's region: nobody else frees it
            (self.shm_dir / region).unlink(missing_ok=True)
        self._regions.clear()

    def _recover(self, model: str) -> None:
        if model not in self._reloading:
            logger.error("the stub of model %r died; reloading the model", model)
            self._reloading.add(model)
            self._notify(model)
        try:
            self.reload(model)
        except Exception as err:  # noqa: BLE001 - retried at the next poll
            logger.error("reload of model %r failed (%s); retrying", model, err)
            return
        stub = find_stubs(self.server_pid, self.repository).get(model)
        if stub is None:
            logger.error("model %r reloaded but no stub is running; retrying", model)
            return
        self._reloading.discard(model)
        self._adopt(model, stub)
        self.restarts[model] += 1
        logger.warning("model %r is back (stub pid %d)", model, stub.pid)
        for follower in self.followers.get(model, ()):
            logger.warning("reloading %r too: its state belonged to %r's requests", follower, model)
            self._reloading.add(follower)  # retried at the next poll if this reload fails
            self._recover(follower)

    def _notify(self, model: str) -> None:
        try:
            self.on_dead(model)
        except Exception:  # noqa: BLE001 - recovery goes on whatever the callback does
            logger.exception("on_dead(%r) raised", model)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one poll
                logger.exception("stage supervisor poll failed")
