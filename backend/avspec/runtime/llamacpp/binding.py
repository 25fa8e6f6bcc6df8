"""Import `llama_cpp` and initialise llama.cpp once per process.

`llama-cpp-python` compiles llama.cpp for the CPU it is built on (`make llamacpp`, pinned in
`LLAMA_CPP_PYTHON`): it is an optional dependency of the runtime, imported only when a stage
asks for the llama.cpp engine. A missing binding is an `EngineUnavailable` naming the command
that installs it. ggml's own log lines go to the `avspec.llamacpp` logger (warnings and errors
at their level, the rest at debug), not to stderr.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from avspec.runtime.cpu_features import read_cpu_flags

PACKAGE, VERSION = "llama-cpp-python", "0.3.36"
LLAMA_CPP_PYTHON = f"{PACKAGE}=={VERSION}"
BUILD_FILE = "llamacpp-build.json"  # in the venv (sys.prefix): the build key it was built for
# How `make llamacpp` compiles it: for this CPU (-march=native), the library and nothing else.
CMAKE_ARGS = (
    "-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
)
# ggml 0.3.36's AMX kernels (ggml-cpu/amx, compiled in by -march=native where the CPU has AMX)
# segfault in the first decode of the default Q4_1 GGUF on an Intel Xeon with AMX; without them
# that CPU runs ggml's AVX-512 (VNNI, bf16) kernels. GCC's explicit -mno-* beats -march=native.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
INSTALL_HINT = "run `make llamacpp` (builds llama-cpp-python for this CPU, about 4-15 minutes)"

logger = logging.getLogger("avspec.llamacpp")
_state: dict[str, Any] = {}
# ggml_log_level: 0 none, 1 debug, 2 info, 3 warn, 4 error, 5 cont
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}


class EngineUnavailable(RuntimeError):
    """The llama.cpp engine was asked for but `llama_cpp` cannot be imported here."""


def cpu_key(flags: frozenset[str] | None = None) -> str:
    """This CPU's build key: the machine, the Python tag and a hash of its flags."""
    flags = read_cpu_flags() if flags is None else flags
    digest = hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:16]
    return f"{os.uname().machine}-py{sys.version_info.major}{sys.version_info.minor}-{digest}"


def compiler_flags(flags: frozenset[str] | None = None) -> str:
    """CFLAGS and CXXFLAGS of this CPU's build: AMX left out where the CPU has it."""
    flags = read_cpu_flags() if flags is None else flags
    return NO_AMX if any(flag.startswith("amx") for flag in flags) else ""


def build_key(flags: frozenset[str] | None = None) -> str:
    """The key of this CPU's llama.cpp build: `cpu_key` and a hash of the build recipe, so a
    changed recipe never reuses a wheel (or a venv) built by an older one."""
    recipe = f"{VERSION} {CMAKE_ARGS} {compiler_flags(flags)}"
    return f"{cpu_key(flags)}-{hashlib.sha256(recipe.encode()).hexdigest()[:8]}"


def installed_key(prefix: Path | None = None) -> str | None:
    """The build key of this venv's llama-cpp-python (None: not built by `make llamacpp`)."""
    try:
        record = json.loads((Path(prefix or sys.prefix) / BUILD_FILE).read_text())
        return str(record["build_key"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def llama_cpp() -> ModuleType:
    """The `llama_cpp` module, its backend initialised and its log routed (once)."""
    cached: ModuleType | None = _state.get("module")
    if cached is not None:
        return cached
    built_for, here = installed_key(), build_key()
    if built_for is not None and built_for != here:
        raise EngineUnavailable(
            f"this venv's {LLAMA_CPP_PYTHON} was built for another CPU or by an older recipe "
            f"({built_for}, this one needs {here}): its instructions may not exist here or its "
            f"kernels may be ones left out since; {INSTALL_HINT}"
        )
    try:
        import llama_cpp as module  # noqa: PLC0415 - optional, heavy: imported on first use
    except ImportError as err:
        raise EngineUnavailable(
            f"the llama.cpp engine needs {LLAMA_CPP_PYTHON} ({err}); {INSTALL_HINT}"
        ) from err
    module.llama_backend_init()
    callback = module.llama_log_callback(_log)
    module.llama_log_set(callback, ctypes.c_void_p(0))
    _state.update(module=module, callback=callback)  # the callback must outlive the library
    return module


def _log(level: int, text: bytes, _user_data: ctypes.c_void_p) -> None:
    line = text.decode("utf-8", "replace").rstrip()
    if line:
        logger.log(_LEVELS.get(level, logging.DEBUG), "%s", line)
