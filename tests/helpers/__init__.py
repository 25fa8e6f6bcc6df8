"""Helpers shared by the tests (on sys.path through pyproject's `pythonpath = ["tests"]`).

- `stages`: tiny float64 models and step inputs for the stage, step and adapter tests;
- `server`: the serving tests' constants, tiny model pair and polling helpers;
- `clients`: small HTTP / gRPC clients of the `speculative` model;
- `client_scripts`: the one way to import a `client/*.py` script;
- `front_fakes`: fake upstreams of the front.

Shared fixtures live in tests/conftest.py; fixtures of one folder in that folder's conftest.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the project root
