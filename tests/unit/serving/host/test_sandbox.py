"""The server's sandbox: who it runs as, what it sees, whose /dev/shm (avspec.serving.host.sandbox).

The script part runs for real where it can: as root (CI), a child dropped to the server's user
with a private /dev/shm; as `nobody` through the system's Python (this host's venv Python lives
where `nobody` cannot enter), the unprivileged user-namespace path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from avspec.serving.host import sandbox
from avspec.serving.host.sandbox import (
    ServerUser,
    blocked_directories,
    sandbox_command,
    server_user,
)

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root")
USER = ServerUser(10001, 10001)


def test_server_user_defaults_to_a_dedicated_uid_only_for_root() -> None:
    assert server_user(None, euid=0) == USER
    assert server_user("2000:3000", euid=0) == ServerUser(2000, 3000)
    assert server_user("2000", euid=0) == ServerUser(2000, 2000)
    assert server_user("nobody", euid=0).uid == 65534
    assert server_user("root", euid=0) is None  # the operator's explicit choice
    assert server_user(None, euid=1234) is None  # not root: runs as the caller
    assert server_user("1234", euid=1234) is None
    with pytest.raises(ValueError, match="only root"):
        server_user("2000", euid=1234)
    with pytest.raises(ValueError, match="no user named"):
        server_user("no-such-user-here", euid=0)
    with pytest.raises(ValueError, match="is root"):
        server_user("0", euid=0)


def test_blocked_directories_are_found_outermost_first(tmp_path: Path) -> None:
    """A directory the user cannot enter on the way to a needed path is listed with the entry
    under it; writable when a writable path runs through that entry."""
    outer = tmp_path / "outer"
    (outer / "inner" / "models").mkdir(parents=True)
    (outer / "runs").mkdir()
    tmp_path.chmod(0o755)
    outer.chmod(0o700)
    (outer / "inner").chmod(0o700)
    found = blocked_directories([outer / "inner" / "models"], [outer / "runs"], USER)
    found = {d: e for d, e in found.items() if d.is_relative_to(outer)}  # pytest's own are 0700
    if os.geteuid() == 0 or os.getuid() != USER.uid:
        assert list(found) == [outer, outer / "inner"]
        assert found[outer] == {"inner": False, "runs": True}
        assert found[outer / "inner"] == {"models": False}
    outer.chmod(0o711)  # enterable by others: no view needed
    assert outer not in blocked_directories([outer / "inner" / "models"], [], USER)


def test_sandbox_command_runs_this_file_in_isolated_mode() -> None:
    command = sandbox_command(["/bin/true", "-x"], USER, [Path("/a")], [Path("/b")])
    assert command[1:3] == ["-I", str(Path(sandbox.__file__).resolve())]
    assert command[3:] == [
        "--uid", "10001", "--gid", "10001", "--expose=/a", "--writable=/b", "--", "/bin/true", "-x",
    ]  # fmt: skip
    assert "--uid" not in sandbox_command(["/bin/true"], None)


def _run_sandboxed(tmp_path: Path, user: ServerUser | None, shell: str) -> list[str]:
    command = sandbox_command(["/bin/sh", "-c", shell], user, [tmp_path / "shown"])
    result = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.split()


@ROOT_ONLY
def test_as_root_the_child_drops_to_the_user_with_a_private_shm(tmp_path: Path) -> None:
    """The child runs as the server's user, its /dev/shm is a fresh 0700 tmpfs of that user
    (the host's regions invisible), and a needed path under a 0700 directory is readable."""
    (tmp_path / "shown").mkdir()
    (tmp_path / "shown" / "file").write_text("seen\n")
    (tmp_path / "hidden").write_text("secret")
    tmp_path.chmod(0o700)
    marker = Path("/dev/shm") / f"avspec-test-host-{os.getpid()}"
    marker.write_text("host")
    try:
        out = _run_sandboxed(
            tmp_path,
            USER,
            f"id -u; id -G; stat -c %a:%u /dev/shm; ls -a /dev/shm | grep -c {marker.name}; "
            f"cat {tmp_path}/shown/file; cat {tmp_path}/hidden 2>/dev/null || echo denied; "
            "umask",
        )
    finally:
        marker.unlink()
    assert out == ["10001", "10001", "700:10001", "0", "seen", "denied", "0077"]


@ROOT_ONLY
@pytest.mark.skipif(not Path("/usr/bin/python3").exists(), reason="no system Python")
def test_as_another_user_the_child_gets_a_private_shm_in_a_user_namespace(
    tmp_path: Path,
) -> None:
    """Not root: the same private /dev/shm through an unprivileged user namespace, the uid
    unchanged (run as nobody with the system's Python, which nobody may execute)."""
    shared = Path(tempfile.mkdtemp(prefix="avspec-sandbox-test-", dir="/tmp"))  # nobody reads it
    try:
        shared.chmod(0o755)
        script = shutil.copy(sandbox.__file__, shared / "sandbox.py")
        shell = "id -u; stat -c %a:%u /dev/shm; ls /dev/shm | wc -l"
        result = subprocess.run(
            ["su", "-s", "/bin/sh", "nobody", "-c",
             f"/usr/bin/python3 -I {script} -- /bin/sh -c '{shell}'"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    finally:
        shutil.rmtree(shared)
    if "no private mount namespace" in result.stderr:
        pytest.skip(f"user namespaces refused here: {result.stderr.strip()}")
    assert result.stdout.split() == ["65534", "700:65534", "0"], result.stderr
