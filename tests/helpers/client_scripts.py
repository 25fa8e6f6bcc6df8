"""Load a `client/*.py` script as a module for tests (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from helpers import ROOT

CLIENT = ROOT / "client"


def load_client_script(name: str) -> ModuleType:
    """Import client/<name>.py, registered as sys.modules[name] (dataclasses look it up there)."""
    spec = importlib.util.spec_from_file_location(name, CLIENT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def load_profile_serving_costs() -> ModuleType:
    """client/profile_serving_costs.py, after bench_overhead.py (which it imports by name)."""
    load_client_script("bench_overhead")
    return load_client_script("profile_serving_costs")
