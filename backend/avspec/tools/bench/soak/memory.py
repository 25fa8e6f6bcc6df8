"""Memory of a running server: RSS of tritonserver and its Python-backend stubs, /dev/shm.

tritonserver is found from its pid or a launcher's; its stubs (one per Python-backend model,
children of the server) by avspec.serving.host.supervisor.find_stubs. RSS is VmRSS of
/proc/<pid>/status. /dev/shm is the total size of the files in it, the stubs' own regions
counted apart. A stub whose pid changes between samples was restarted.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from avspec.serving.host.supervisor import find_stubs, proc_stat_fields

SHM_DIR = Path("/dev/shm")
SERVER_NAME = "tritonserver"


def parse_vmrss_kib(status: str) -> int | None:
    """VmRSS in KiB from the text of /proc/<pid>/status; None if absent (a zombie)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return None


def rss_mib(pid: int) -> float | None:
    """Resident memory of `pid` in MiB, None if it is gone."""
    try:
        kib = parse_vmrss_kib(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None
    return None if kib is None else kib / 1024


def shm_usage(directory: Path = SHM_DIR) -> dict[str, int]:
    """{file name: size in bytes} of the regular files directly in `directory`."""
    usage = {}
    for entry in directory.iterdir():
        try:
            if entry.is_file():
                usage[entry.name] = entry.stat().st_size
        except OSError:  # removed meanwhile
            continue
    return usage


def shm_after_stop(
    before: dict[str, int], ours: set[str], timeout_s: float = 10.0, directory: Path = SHM_DIR
) -> dict:
    """/dev/shm after the server stopped: totals, and the server's regions still there.

    Waits up to `timeout_s` for the regions to go (the stubs remove theirs as they exit).
    Files that appeared meanwhile and are not the server's (another process on this machine)
    are listed but not held against the run.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        after = shm_usage(directory)
        left = sorted(n for n in after if n in ours)
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    return {
        "before_bytes": sum(before.values()),
        "after_bytes": sum(after.values()),
        "returned_to_baseline": sum(after.values()) <= sum(before.values()),
        "server_regions": sorted(ours),
        "server_regions_left": left,
        "other_new_files": sorted(n for n in after if n not in before and n not in ours),
    }


def repository_from_cmdline(argv: list[str]) -> Path | None:
    """The --model-repository (or --model-store) of a tritonserver command line."""
    for i, arg in enumerate(argv):
        for flag in ("--model-repository", "--model-store"):
            if arg.startswith(flag + "="):
                return Path(arg.split("=", 1)[1])
            if arg == flag and i + 1 < len(argv):
                return Path(argv[i + 1])
    return None


def cmdline(pid: int) -> list[str]:
    """The command line of `pid`; OSError if it is gone."""
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _comm(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def _parents() -> dict[int, int]:
    """{pid: parent pid} of every process /proc shows."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat_fields(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
    return parents


def find_tritonserver(pid: int) -> int:
    """`pid` if it is tritonserver, else its first tritonserver descendant (a launcher's child).

    ValueError if there is none.
    """
    if _comm(pid) == SERVER_NAME:
        return pid
    parents = _parents()
    frontier = [pid]
    while frontier:
        children = sorted(c for c, p in parents.items() if p in frontier)
        for child in children:
            try:
                if _comm(child) == SERVER_NAME:
                    return child
            except OSError:
                continue
        frontier = children
    raise ValueError(f"process {pid} is not tritonserver and has no tritonserver descendant")


@dataclass
class MemorySampler:
    """Samples RSS of tritonserver and its stubs and the /dev/shm total every `interval_s`.

    `requests_done` is called at each sample (the load's progress, kept with the sample). A stub
    whose pid changes between samples was restarted: that is recorded in `restarts`.
    """

    server_pid: int
    repository: Path
    requests_done: Callable[[], int]
    interval_s: float = 5.0
    shm_dir: Path = SHM_DIR
    samples: list[dict] = field(default_factory=list)
    restarts: list[dict] = field(default_factory=list)
    regions: set[str] = field(default_factory=set)  # the stubs' shm regions (file names)
    start: float = field(default_factory=time.monotonic)
    _pids: dict[str, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> dict:
        """Take one sample now and append it."""
        pids = {SERVER_NAME: self.server_pid}
        for model, stub in sorted(find_stubs(self.server_pid, self.repository).items()):
            pids[model] = stub.pid
            self.regions.add(stub.shm_region.lstrip("/"))
        t = round(time.monotonic() - self.start, 2)
        for name, pid in pids.items():
            old = self._pids.get(name)
            if old is not None and old != pid:
                self.restarts.append({"t": t, "process": name, "old_pid": old, "new_pid": pid})
            self._pids[name] = pid
        rss = {name: rss_mib(pid) for name, pid in pids.items()}
        shm = shm_usage(self.shm_dir)
        record = {
            "t": t,
            "rss_mib": {n: round(v, 1) for n, v in rss.items() if v is not None},
            "shm_bytes": sum(shm.values()),
            "server_shm_bytes": sum(v for n, v in shm.items() if n in self.regions),
            "requests_done": self.requests_done(),
        }
        self.samples.append(record)
        return record

    def start_thread(self) -> None:
        """Take a first sample, then one every `interval_s` in a background thread."""
        self.sample()
        self._thread = threading.Thread(target=self._loop, name="soak-memory", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and take a last sample."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def series(self) -> dict[str, tuple[list[float], list[float]]]:
        """{process: (times, MiB)} over the samples that saw it."""
        out: dict[str, tuple[list[float], list[float]]] = {}
        for s in self.samples:
            for name, value in s["rss_mib"].items():
                times, values = out.setdefault(name, ([], []))
                times.append(s["t"])
                values.append(value)
        return out
