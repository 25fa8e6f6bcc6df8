"""Build `llama-cpp-python` for this CPU once, install it into this venv (`make llamacpp`).

    python -m avspec.tools.setup.llamacpp_build            # build if needed, install, check
    python -m avspec.tools.setup.llamacpp_build --check    # exit 1 unless this venv's build fits

llama.cpp is compiled for the CPU it is built on (`-DGGML_NATIVE=ON`: AVX-512, bf16 and VNNI
kernels where the CPU has them; ggml's AMX kernels are left out, they crash in this version), and
the wheel it yields is tagged for any x86-64 Linux, so pip's own cache would hand it to a CPU
that lacks those instructions (a crash on the first illegal instruction). The wheel is therefore
kept in a directory named by this CPU's flags and the build recipe (`binding.build_key`),
`~/.cache/avspec/llamacpp/<key>/` (`AVSPEC_CACHE` moves it): the first build on a kind of CPU
takes 4-15 minutes on 2 cores (a progress line counts them), every later install there is
instant, and a CPU with other flags, or a changed recipe, builds its own. The source
distribution is fetched by pip with its sha256 pinned. The venv records the key it was
installed for (`BUILD_FILE` in the venv), and the engine refuses a build made for another CPU
or by another recipe (`avspec.runtime.llamacpp.binding`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from avspec.runtime.llamacpp.binding import (
    BUILD_FILE,
    CMAKE_ARGS,
    PACKAGE,
    VERSION,
    build_key,
    compiler_flags,
    installed_key,
)

SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"


def cache_dir(key: str) -> Path:
    root = Path(os.environ.get("AVSPEC_CACHE", Path.home() / ".cache" / "avspec"))
    return root / "llamacpp" / key


def build_wheel(directory: Path) -> Path:
    """Fetch the pinned source and build its wheel into `directory`; the wheel's path."""
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="avspec-llamacpp-") as work:
        requirements = Path(work) / "requirements.txt"
        requirements.write_text(f"{PACKAGE}=={VERSION} --hash=sha256:{SDIST_SHA256}\n")
        env, extra = dict(os.environ, CMAKE_ARGS=CMAKE_ARGS), compiler_flags()
        for name in ("CFLAGS", "CXXFLAGS"):  # the user's own flags kept, ours after them
            env[name] = " ".join(filter(None, (env.get(name, ""), extra)))
        env.setdefault("CMAKE_BUILD_PARALLEL_LEVEL", str(len(os.sched_getaffinity(0))))
        command = [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir",
            "--no-binary", PACKAGE, "--require-hashes", "-r", str(requirements),
            "-w", str(Path(work) / "out"),
        ]  # fmt: skip
        log_path = directory.parent / f"{directory.name}.build.log"
        with open(log_path, "w") as log_file, _Ticker("building llama.cpp for this CPU"):
            result = subprocess.run(command, env=env, stdout=log_file, stderr=subprocess.STDOUT)
        if result.returncode:
            tail = log_path.read_text(errors="replace").splitlines()[-20:]
            raise SystemExit("llama-cpp-python did not build (log: {}):\n{}".format(
                log_path, "\n".join(tail)))  # fmt: skip
        (wheel,) = (Path(work) / "out").glob("*.whl")
        final = directory / wheel.name
        os.replace(wheel, final)  # whole wheels only: a killed build leaves nothing here
    return final


def install(key: str) -> None:
    directory = cache_dir(key)
    wheels = sorted(directory.glob(f"llama_cpp_python-{VERSION}-*.whl"))
    wheel = wheels[0] if wheels else build_wheel(directory)
    print(f"[llamacpp] installing {wheel}", file=sys.stderr, flush=True)
    constraints = Path(__file__).resolve().parents[4] / "constraints.txt"
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    if constraints.is_file():
        pip += ["-c", str(constraints)]
    subprocess.run([*pip, str(wheel)], check=True)  # its dependencies, pinned
    subprocess.run([*pip, "--force-reinstall", "--no-deps", str(wheel)], check=True)  # this build
    record = {"build_key": key, "wheel": str(wheel), "cmake_args": CMAKE_ARGS,
              "compiler_flags": compiler_flags()}  # fmt: skip
    (Path(sys.prefix) / BUILD_FILE).write_text(json.dumps(record, indent=2) + "\n")


class _Ticker:
    """A progress line on stderr, rewritten every 5 s with the minutes spent."""

    def __init__(self, what: str) -> None:
        self.what, self.stop = what, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Ticker:
        self.started = time.monotonic()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        spent = time.monotonic() - self.started
        print(f"\r[llamacpp] {self.what}: done in {spent / 60:.1f} min", file=sys.stderr)

    def _run(self) -> None:
        while not self.stop.wait(5):
            spent = time.monotonic() - self.started
            print(f"\r[llamacpp] {self.what}: {spent / 60:.1f} min (usually 4-15)",
                  end="", file=sys.stderr, flush=True)  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.setup.llamacpp_build", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--check", action="store_true", help="only check this venv's build")
    args = parser.parse_args(argv)
    key = build_key()
    if installed_key() == key:
        print(f"[llamacpp] {PACKAGE} {VERSION} is installed for this CPU ({key})", file=sys.stderr)
        return 0
    if args.check:
        print(f"[llamacpp] no build for this CPU ({key}) in this venv: run `make llamacpp`",
              file=sys.stderr)  # fmt: skip
        return 1
    install(key)
    print(f"[llamacpp] {PACKAGE} {VERSION} installed for this CPU ({key})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
