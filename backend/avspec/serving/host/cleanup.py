"""Remove what crashed Triton Python backends leave behind: shared-memory regions, env dirs.

After an abnormal exit the Python backend leaves its shared-memory pools in /dev/shm (one per
model instance, megabytes each, held in RAM until deleted) and empty `python_env_XXXXXX`
directories in /tmp (the backend's `mkdtemp` template hardcodes /tmp, TMPDIR is not read).

The launcher starts tritonserver with `--backend-config=python,shm-region-prefix-name=
avspec<PID>_` (`shm_prefix`), PID being the launcher's own, so a region's owner is in its name:
a region is stale when that PID no longer runs. Regions with Triton's default name
(`triton_python_backend_shm_region_<n>`, from runs without the prefix) carry no owner: they are
stale when no process maps or holds them open. Every candidate, prefixed or not, must also pass
that last test: a server started by other means (or an older launcher, without the
parent-death signal of avspec.serving.host.sandbox) outlives a launcher killed with SIGKILL.

An env dir names no owner and a live server's stays empty all its life, but tritonserver aborts
at exit if it was removed (`~EnvironmentManager`: "fts_read error ... No such file or
directory", exit status -6). Empty dirs are therefore removed only while no process has the
Python backend (`libtriton_python.so`) mapped; comparing dir times with process start times
would mix the wall clock with boot time, which a clock step (a resumed VM) breaks. Dirs left
while other servers run wait for a later start (they are empty: 4 KB each).

Limits: liveness and use are read from this PID namespace's /proc, skipping processes it may not
read (another user's); a /dev/shm shared with another PID namespace (docker --ipc=host) holds
regions whose users are invisible here. Only files owned by this user are considered: another
user's leftovers are theirs (/dev/shm and /tmp are sticky, we could not remove them anyway).
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
TMP_DIR = Path("/tmp")  # not tempfile.gettempdir(): the backend's template is a literal /tmp
PROC_DIR = Path("/proc")
BACKEND_LIBRARY = "libtriton_python.so"
LEGACY_SHM_PREFIX = "triton_python_backend_shm_region_"
ENV_DIR_PREFIX = "python_env_"
_PREFIXED = re.compile(r"avspec(\d+)_")


@dataclass(frozen=True)
class CleanupReport:
    """What `clean_leftovers` removed, and how many removals failed (logged, skipped)."""

    shm_regions: int = 0
    shm_bytes: int = 0
    env_dirs: int = 0
    errors: int = 0


def shm_prefix(pid: int) -> str:
    """The shared-memory region name prefix of the launcher with process id `pid`."""
    return f"avspec{pid}_"


def pid_running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (exited, waiting to be reaped)."""
    try:
        text = (PROC_DIR / str(pid) / "stat").read_text()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (or unreadable): existence is all we can learn
        return _pid_exists(pid)
    # "pid (comm) state ...": comm may hold spaces and parentheses, the state follows the last ")"
    fields = text.rpartition(")")[2].split()
    return not fields or fields[0] not in ("Z", "X")


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def paths_in_use(proc_dir: Path = PROC_DIR) -> set[str] | None:
    """Every file path some readable process maps or holds open; None if /proc is unreadable.

    Read from /proc/<pid>/maps and /proc/<pid>/fd; processes that vanish or may not be read are
    skipped. Paths are as the kernel prints them, without a " (deleted)" suffix.
    """
    try:
        pids = [p for p in proc_dir.iterdir() if p.name.isdigit()]
    except OSError:
        return None
    used: set[str] = set()
    for pid_dir in pids:
        used.update(_mapped_paths(pid_dir))
        used.update(_open_paths(pid_dir))
    return used


def _mapped_paths(pid_dir: Path) -> Iterable[str]:
    try:
        lines = (pid_dir / "maps").read_text().splitlines()
    except (OSError, UnicodeDecodeError):
        return []
    # "address perms offset dev inode pathname": the path is the 6th field and may hold spaces
    paths = (parts[5] for line in lines if len(parts := line.split(maxsplit=5)) == 6)
    return [p.removesuffix(" (deleted)") for p in paths if p.startswith("/")]


def _open_paths(pid_dir: Path) -> Iterable[str]:
    try:
        fds = list((pid_dir / "fd").iterdir())
    except OSError:
        return []
    paths = []
    for fd in fds:
        try:
            paths.append(os.readlink(fd).removesuffix(" (deleted)"))
        except OSError:  # closed meanwhile
            continue
    return paths


def stale_shm_regions(shm_dir: Path = SHM_DIR) -> list[Path]:
    """Regions in `shm_dir` left by dead launchers or crashed unprefixed runs, sorted by name.

    A prefixed region is stale when its launcher PID does not run; a region with Triton's
    default name is a candidate as is. Either is returned only if no process maps or holds it.
    """
    candidates = [p for p in _own_entries(shm_dir, stat.S_ISREG) if _unowned(p.name)]
    if not candidates:
        return []
    in_use = paths_in_use()
    if in_use is None:  # cannot tell who uses what: remove nothing
        return []
    return [p for p in candidates if os.path.realpath(p) not in in_use]


def _unowned(name: str) -> bool:
    """Whether region `name` has no running owner: a dead launcher's prefix, or no prefix."""
    match = _PREFIXED.match(name)
    if match is not None:
        return not pid_running(int(match.group(1)))
    return name.startswith(LEGACY_SHM_PREFIX)


def stale_env_dirs(tmp_dir: Path = TMP_DIR, min_age_s: float = 60.0) -> list[Path]:
    """Empty `python_env_*` directories in `tmp_dir` not modified for `min_age_s`, sorted.

    None while any process runs the Python backend (one of them may own any empty dir, see
    the module docstring). Symlinks are never followed.
    """
    deadline = time.time() - min_age_s
    stale = []
    for path in _own_entries(tmp_dir, stat.S_ISDIR):
        if not path.name.startswith(ENV_DIR_PREFIX):
            continue
        try:
            if path.lstat().st_mtime <= deadline and not any(path.iterdir()):
                stale.append(path)
        except OSError:  # removed or unreadable meanwhile
            continue
    if stale and python_backend_running():
        return []
    return stale


def python_backend_running() -> bool:
    """Whether a readable process has the Python backend library mapped (True if unknown)."""
    in_use = paths_in_use()
    if in_use is None:
        return True
    return any(os.path.basename(path) == BACKEND_LIBRARY for path in in_use)


def _own_entries(directory: Path, kind: Callable[[int], bool]) -> list[Path]:
    """Entries of `directory` of file type `kind` (an S_IS* test) owned by us, sorted by name."""
    try:
        entries = list(directory.iterdir())
    except OSError:  # no such directory (not Linux), or unreadable
        return []
    uid = os.geteuid()
    found = []
    for path in entries:
        try:
            info = path.lstat()
        except OSError:
            continue
        if kind(info.st_mode) and info.st_uid == uid:
            found.append(path)
    return sorted(found)


def remove_regions(prefix: str, shm_dir: Path = SHM_DIR) -> int:
    """Remove the regions named `prefix`* (a dead server's, once its process group is gone);
    return how many. Failures are logged, never raised."""
    removed = 0
    try:
        paths = sorted(p for p in shm_dir.iterdir() if p.name.startswith(prefix))
    except OSError:
        return 0
    for path in paths:
        try:
            path.unlink()
            removed += 1
        except OSError as err:
            logger.warning("could not remove shared-memory region %s: %s", path, err)
    return removed


def clean_leftovers(
    shm_dir: Path = SHM_DIR, tmp_dir: Path = TMP_DIR, min_age_s: float = 60.0
) -> CleanupReport:
    """Remove stale shared-memory regions and empty env dirs; log one line; never raise.

    Each failed removal is logged as a warning and counted in `errors`. Directories are removed
    with rmdir, which fails rather than deletes if something was written there meanwhile.
    """
    regions = removed_bytes = dirs = errors = 0
    for path in stale_shm_regions(shm_dir):
        try:
            size = path.lstat().st_size
            path.unlink()
        except OSError as err:
            logger.warning("could not remove stale shared-memory region %s: %s", path, err)
            errors += 1
            continue
        regions += 1
        removed_bytes += size
    for path in stale_env_dirs(tmp_dir, min_age_s):
        try:
            os.rmdir(path)
        except OSError as err:
            logger.warning("could not remove empty backend env directory %s: %s", path, err)
            errors += 1
            continue
        dirs += 1
    report = CleanupReport(regions, removed_bytes, dirs, errors)
    logger.info(
        "removed %d stale shared-memory regions (%.1f MB) from %s and %d empty %s* directories "
        "from %s (%d failed)",
        regions,
        removed_bytes / 1e6,
        shm_dir,
        dirs,
        ENV_DIR_PREFIX,
        tmp_dir,
        errors,
    )
    return report
