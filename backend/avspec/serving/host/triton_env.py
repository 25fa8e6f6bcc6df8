"""What it takes to run a tritonserver: its binary, backend directory and environment.

Two kinds of server:
- the one bundled in the nvidia-pytriton wheel (the CPU deployment): the wheel carries a complete
  tritonserver, the Python backend and one backend stub per Python version (Triton
  2.51). Starting it takes a backend directory holding `python/` with
  `libtriton_python.so`, `triton_python_backend_utils.py` and the stub matching this interpreter;
  LD_LIBRARY_PATH with this interpreter's libpython and the wheel's bundled libraries; PYTHONPATH
  so the stub processes import this environment's packages and `avspec`;
- an installed one (the NGC container, docs/gpu.md): its image provides the backends
  (/opt/tritonserver/backends), python3 and PYTHONPATH, so none of the above applies.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import avspec

BACKEND_SOURCE_DIR = Path(avspec.__file__).resolve().parent.parent  # the `backend/` directory


def pytriton_root() -> Path:
    """Return the installed `pytriton` package directory (holding `tritonserver/`)."""
    import pytriton  # imported here: only the bundled server needs the wheel

    return Path(pytriton.__file__).resolve().parent


def tritonserver_binary() -> Path:
    """Return the path of the bundled `tritonserver` executable (FileNotFoundError if absent)."""
    binary = pytriton_root() / "tritonserver" / "bin" / "tritonserver"
    if not binary.is_file():
        raise FileNotFoundError(
            f"tritonserver not found at {binary}: is nvidia-pytriton installed?"
        )
    return binary


def find_tritonserver(name: str | Path) -> Path:
    """Return the executable `name` names: a path, or a bare name looked up on PATH."""
    if os.sep not in str(name):
        found = shutil.which(str(name))
        if found is None:
            raise FileNotFoundError(f"no {name!r} on PATH ({os.environ.get('PATH', '')})")
        return Path(found).resolve()
    binary = Path(name).resolve()
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise FileNotFoundError(f"tritonserver {binary} is not an executable file")
    return binary


def is_bundled(binary: Path) -> bool:
    """Whether `binary` is the wheel's tritonserver (False when the wheel is not installed)."""
    try:
        return binary.resolve() == tritonserver_binary().resolve()
    except (ImportError, FileNotFoundError):
        return False


def prepare_backend_directory(target: Path) -> Path:
    """Assemble `<target>/python/` with the wheel's Python backend and this interpreter's stub."""
    dist = pytriton_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.is_file():
        raise FileNotFoundError(f"no Python backend stub for Python {version} at {stub}")
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    for source in (
        dist / "backends" / "python" / "libtriton_python.so",
        dist / "backends" / "python" / "triton_python_backend_utils.py",
        stub,
    ):
        shutil.copy2(source, python_dir / source.name)
    return target


def server_environment(
    base: dict[str, str] | None = None, cpu_threads: int | None = 1, *, bundled: bool = True
) -> dict[str, str]:
    """Return the environment for tritonserver and its Python stub processes.

    cpu_threads sets OMP_NUM_THREADS for every stub process (None: leave as is). Each model
    instance is its own process; with torch's default of one spinning thread per core in each,
    the stages fight over the cores (measured on 2 cores: a 20-token request 9 s vs 0.8 s).
    That holds for any server, so it applies to both kinds. bundled=False (an installed server)
    leaves the library and module paths to the image: the wheel's would be wrong there.

    Memory settings, for both kinds too (values already in `base` win), so that the stage stubs'
    resident size stays flat under load (what each one fixes and costs: docs/reliability.md,
    "Memory under load"): a fixed glibc mmap threshold of 1 MiB (MALLOC_MMAP_THRESHOLD_),
    transparent huge pages for its mappings (GLIBC_TUNABLES glibc.malloc.hugetlb=1), a
    oneDNN kernel cache of 64 entries (ONEDNN_PRIMITIVE_CACHE_CAPACITY) and a cache of 128 of
    torch's CPU bf16 matmuls (LRU_CACHE_CAPACITY, read by torch's ideep at its first matmul;
    default 1024: new entries for each new token count, which grew the bf16 draft's resident
    size by a third over a 10-minute soak). A stage may raise its own mmap threshold
    (avspec.serving.stages.heap.set_mmap_threshold).
    """
    env = dict(os.environ if base is None else base)
    if cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    if not any(t.startswith("glibc.malloc.hugetlb=") for t in tunables):
        env["GLIBC_TUNABLES"] = ":".join([*tunables, "glibc.malloc.hugetlb=1"])
    env.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "64")
    env.setdefault("LRU_CACHE_CAPACITY", "128")
    if not bundled:
        return env
    libs = [
        sysconfig.get_config_var("LIBDIR"),
        str(pytriton_root().parent / "nvidia_pytriton.libs"),
    ]
    paths = [str(BACKEND_SOURCE_DIR), sysconfig.get_paths()["purelib"]]
    # The stub's embedded interpreter finds its prefix (and this venv's site-packages, with the
    # editable install of avspec) from the first `python3` on PATH, as PyTriton's launcher does.
    bindir = [str(Path(sys.executable).parent)]
    for key, extra in (("LD_LIBRARY_PATH", libs), ("PYTHONPATH", paths), ("PATH", bindir)):
        existing = [p for p in env.get(key, "").split(os.pathsep) if p]
        env[key] = os.pathsep.join(extra + existing)
    return env


@dataclass(frozen=True)
class TritonInstall:
    """A tritonserver to run: its binary, whether it is the wheel's, a backend directory."""

    binary: Path
    bundled: bool
    backend_directory: Path | None = None  # used as is; None: see `assembles_backends`

    @classmethod
    def find(
        cls, tritonserver: str | Path | None = None, backend_directory: str | Path | None = None
    ) -> TritonInstall:
        """Resolve `tritonserver` (None: the wheel's); FileNotFoundError or ImportError."""
        binary = tritonserver_binary() if tritonserver is None else find_tritonserver(tritonserver)
        backends = Path(backend_directory).resolve() if backend_directory else None
        if backends is not None and not backends.is_dir():
            raise FileNotFoundError(f"backend directory {backends} is not a directory")
        return cls(binary, is_bundled(binary), backends)

    @property
    def assembles_backends(self) -> bool:
        """Whether a backend directory must be assembled (`prepare_backend_directory`).

        Only for the wheel's server given none; an installed server without one uses its own
        default (for the NGC image, /opt/tritonserver/backends).
        """
        return self.bundled and self.backend_directory is None

    def environment(self, cpu_threads: int | None) -> dict[str, str]:
        """This environment as the server and its stubs need it (`server_environment`)."""
        return server_environment(cpu_threads=cpu_threads, bundled=self.bundled)
