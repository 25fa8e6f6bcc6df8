"""Run the server as a non-root user, with shared memory no other user can see.

`enter_sandbox(user, expose)` turns the calling process (single-threaded: it runs first thing
in a fresh process) into the server's sandbox, and everything it starts inherits it:

1. a private mount namespace with its own tmpfs on /dev/shm (mode 0700, owned by the server's
   user): the Python backend creates its regions with mode 0644 (boost sets it after creation,
   whatever the umask), and request tensors pass through them; in a private tmpfs no other
   user, and no process outside the server, can open them, and they vanish with the server's
   last process (nothing is left in /dev/shm after a crash). As root this takes
   unshare(CLONE_NEWNS); as another user, an unprivileged user namespace mapping only that user
   to itself (the uid stays the same; the namespace's capabilities are gone at the next exec);
2. as root, views: a path the server needs (the Python installation, the virtual environment,
   the repositories, the models) may lie under a directory the server's user cannot enter
   (Python installed in /root, a test's 0700 temporary directory). Such a directory is covered,
   in this namespace only, by a tmpfs the user may enter but not list, holding just the needed
   entries, bound back (read-only, but for the directories the server writes: its snapshot's).
   The real directory's permissions are untouched;
3. as root: drop to the server's user (no supplementary groups), so nothing runs as root;
4. umask 077, so the sockets and files the server creates are its user's alone;
5. with `die_with_parent` (tritonserver): the kernel kills the process when the launcher dies,
   even by SIGKILL, so no server is left behind holding the sockets and the models' memory.

Run as a script (`sandbox_command`), this file does the above and then execs the command: so
tritonserver keeps its process id for the launcher's process group and the supervisor. The
launcher itself re-executes through it when started as root (avspec.serving.host.launcher).

Where namespaces are not allowed (a container's default seccomp profile), steps 1-2 are skipped
with a warning on stderr: the regions then live in the host's /dev/shm with mode 0644 (in a
container that /dev/shm is the container's own). Step 3 always applies.

The script part uses only the standard library: it runs in a fresh `python -I`.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import os
import pwd
import stat
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

DEFAULT_SERVER_USER = "10001:10001"  # a fixed uid/gid for no other account (as NGC's uid 1000)
ROOT_USER = "root"  # `--user root`: keep root (warned): the operator's explicit choice

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNS = 0x00020000
_CLONE_NEWUSER = 0x10000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
SANDBOXED_ENV = "AVSPEC_SANDBOXED"  # set inside the sandbox: do not enter another


@dataclass(frozen=True)
class ServerUser:
    """The uid and gid tritonserver and its stubs run as."""

    uid: int
    gid: int

    def __str__(self) -> str:
        return f"{self.uid}:{self.gid}"


def server_user(spec: str | None, euid: int | None = None) -> ServerUser | None:
    """The user to drop to, or None to run as the caller.

    Only root drops: `spec` is "NAME", "UID" or "UID:GID" (None: DEFAULT_SERVER_USER), or
    "root" to stay root. Started as another user, the server runs as that user and `spec` must
    be None or name that same user. ValueError for an unknown name or a malformed spec.
    """
    euid = os.geteuid() if euid is None else euid
    if spec == ROOT_USER:
        if euid != 0:
            raise ValueError("--user root needs the launcher to run as root")
        return None
    if euid != 0:
        if spec is not None and _parse_user(spec).uid != euid:
            raise ValueError(f"--user {spec}: only root can run the server as another user")
        return None
    return _parse_user(spec or DEFAULT_SERVER_USER)


def _parse_user(spec: str) -> ServerUser:
    name, _, group = spec.partition(":")
    if name.isdigit():
        uid = int(name)
        gid = int(group) if group.isdigit() else uid
        if group and not group.isdigit():
            raise ValueError(f"user {spec!r}: the group must be a number")
    else:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            message = f"no user named {name!r} (give UID:GID for a user with no entry)"
            raise ValueError(message) from None
        uid, gid = entry.pw_uid, int(group) if group.isdigit() else entry.pw_gid
    if uid == 0:
        raise ValueError(f"user {spec!r} is root: give another user, or 'root' to stay root")
    return ServerUser(uid, gid)


def sandbox_command(
    command: list[str],
    user: ServerUser | None,
    expose: Sequence[Path] = (),
    writable: Sequence[Path] = (),
    *,
    die_with_parent: bool = False,
) -> list[str]:
    """`command` run through this file: private /dev/shm, views of `expose` (read-only) and
    `writable` for `user`, then `user` (None: the caller), umask 077; with `die_with_parent`,
    killed by the kernel when the process that started it dies."""
    ids = ["--uid", str(user.uid), "--gid", str(user.gid)] if user is not None else []
    views = [f"--expose={path}" for path in expose]
    views += [f"--writable={path}" for path in writable]
    death = ["--die-with-parent"] if die_with_parent else []
    here = str(Path(__file__).resolve())
    return [sys.executable, "-I", here, *ids, *views, *death, "--", *command]


def runtime_paths() -> list[Path]:
    """What any Python process of the server needs: the installation and the environment."""
    return [Path(sys.base_prefix), Path(sys.prefix), Path(sys.executable)]


def drop_privileges(user: ServerUser) -> None:
    """Become `user` for good: no supplementary groups, gid, then uid (root only)."""
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)


# --- the script part: runs in the child, before tritonserver ---------------------------------


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def enter_sandbox(
    user: ServerUser | None, expose: Sequence[Path] = (), writable: Sequence[Path] = ()
) -> None:
    """Steps 1-4 of the module docstring for this process (see there); warns on stderr where
    namespaces are refused. `user` None: stay the caller's user (root stays root)."""
    try:
        private_shm(user)
        if user is not None and os.getuid() == 0:
            for blocked, entries in blocked_directories(expose, writable, user).items():
                make_view(blocked, entries)
    except OSError as err:
        print(
            f"avspec: no private mount namespace ({err}); the Python backend's shared-memory "
            "regions are created in the host's /dev/shm with mode 0644",
            file=sys.stderr,
            flush=True,
        )
    if user is not None and os.getuid() == 0:
        drop_privileges(user)
    os.umask(0o077)
    os.environ[SANDBOXED_ENV] = "1"


def enterable(directory: Path, user: ServerUser) -> bool:
    """Whether `user` (with no supplementary groups) may enter `directory`."""
    info = os.stat(directory)
    if info.st_uid == user.uid:
        return bool(info.st_mode & stat.S_IXUSR)
    if info.st_gid == user.gid:
        return bool(info.st_mode & stat.S_IXGRP)
    return bool(info.st_mode & stat.S_IXOTH)


def blocked_directories(
    expose: Sequence[Path], writable: Sequence[Path], user: ServerUser
) -> dict[Path, dict[str, bool]]:
    """{directory `user` cannot enter: {entry on the way to a path: writable?}}, outermost
    directories first (a view of an outer one must exist before an inner one is made). An
    entry is writable when a `writable` path lies under it."""
    blocked: dict[Path, dict[str, bool]] = {}
    for path, rw in [*((p, False) for p in expose), *((p, True) for p in writable)]:
        parts = Path(os.path.realpath(path)).parts
        for depth in range(1, len(parts)):
            directory = Path(*parts[:depth])
            if not enterable(directory, user):
                entries = blocked.setdefault(directory, {})
                entries[parts[depth]] = entries.get(parts[depth], False) or rw
    return dict(sorted(blocked.items(), key=lambda item: len(item[0].parts)))


def make_view(directory: Path, entries: dict[str, bool]) -> None:
    """Cover `directory` with a tmpfs (mode 0711: enter, no listing) holding only `entries`,
    each bound to the original, read-only unless marked writable. In this mount namespace
    only."""
    libc = _libc()
    # staged in the private /dev/shm (step 1), so nothing is left on the host's file system
    staging = Path(tempfile.mkdtemp(prefix=".avspec-view-", dir="/dev/shm"))
    kept = []
    for name in sorted(entries):
        original = directory / name
        if not os.path.lexists(original):
            continue
        target = staging / name
        if original.is_dir():
            target.mkdir()
        else:
            target.touch()
        _check(libc.mount(bytes(original), bytes(target), None, _MS_BIND | _MS_REC, None), "bind")
        kept.append((name, target, original.is_dir(), entries[name]))
    _check(
        libc.mount(b"tmpfs", bytes(directory), b"tmpfs", _MS_NOSUID | _MS_NODEV, b"mode=0711"),
        f"mount tmpfs on {directory}",
    )
    for name, source, is_dir, rw in kept:
        target = directory / name
        if is_dir:
            target.mkdir()
        else:
            target.touch()
        _check(libc.mount(bytes(source), bytes(target), None, _MS_BIND | _MS_REC, None), "bind")
        if rw:
            continue
        flags = _MS_REMOUNT | _MS_BIND | _MS_RDONLY
        _check(libc.mount(None, bytes(target), None, flags, None), f"read-only {target}")


def private_shm(owner: ServerUser | None) -> None:
    """Enter a new mount namespace with a fresh tmpfs on /dev/shm only its owner may enter.

    As root, a mount namespace alone; otherwise a user namespace as well, mapping this process's
    uid and gid to themselves. OSError where the kernel or a seccomp profile refuses.
    """
    libc = _libc()
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        _check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    else:
        _check(libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNS), "unshare(CLONE_NEWUSER|CLONE_NEWNS)")
        Path("/proc/self/setgroups").write_text("deny")
        Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
        Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")
    # mounts made here must not propagate back to the host's namespace
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate /")
    owner_ids = f",uid={owner.uid},gid={owner.gid}" if owner is not None else ""
    options = f"mode=0700{owner_ids}".encode()
    _check(
        libc.mount(b"tmpfs", b"/dev/shm", b"tmpfs", _MS_NOSUID | _MS_NODEV, options),
        "mount tmpfs on /dev/shm",
    )


def die_with_parent(parent: int) -> None:
    """Have the kernel send SIGKILL when the parent dies (set after any change of user, which
    clears it; kept across exec); exit at once if `parent` is already gone."""
    _check(_libc().prctl(_PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    if os.getppid() != parent:
        sys.exit(f"avspec: the launcher (pid {parent}) died before the server started")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uid", type=int)
    parser.add_argument("--gid", type=int)
    parser.add_argument("--expose", type=Path, action="append", default=[])
    parser.add_argument("--writable", type=Path, action="append", default=[])
    parser.add_argument("--die-with-parent", action="store_true")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to run")
    user = ServerUser(args.uid, args.gid) if args.uid is not None else None
    parent = os.getppid()
    if not os.environ.get(SANDBOXED_ENV):  # a launcher inside the sandbox starts tritonserver
        enter_sandbox(user, args.expose, args.writable)
    if args.die_with_parent:
        die_with_parent(parent)
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
