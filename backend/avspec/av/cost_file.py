"""The cost-tables file of a `StepCost`: what the profilers write and the verifier loads.

    {"format": "avspec-step-cost/1",
     "overhead_ms": 1.2,                                   per-step fixed cost (served path hops)
     "verify_row_ms": 0.5,                                 target ms per row (optional, 0)
     "draft_pass": {"sizes": [1, 2, 4, ...], "millis": [...]},   one draft forward, by rows
     "verify": {"sizes": [1, 2, ...], "millis": [...]},          target forward, by tokens
     "measured": {...}}                                    provenance: raw samples or medians and
                                                           repeats, command, threads, date, ...

The tables hold the monotone (isotonic) fit; `measured` is free-form plain data kept for checks
and plots and not read back. Files of the old format (keys "draft_cost" / "verify_cost": the
whole draft stage at K drafts by batch size) do not describe a StepCost and are refused with the
command that re-profiles them.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, TypeGuard

from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost

FORMAT = "avspec-step-cost/1"
TABLES = ("draft_pass", "verify")
PROFILE_COMMAND = (
    "python client/profile_costs.py --output PATH (in-process), or "
    "python client/profile_serving_costs.py --out PATH (on a running deployment)"
)


def save_step_cost(path: str | Path, cost: StepCost, measured: dict[str, Any] | None) -> None:
    """Write `cost` (and `measured`, plain JSON data) to `path` atomically (temp file + rename)."""
    path = Path(path)
    document = {
        "format": FORMAT,
        "overhead_ms": float(cost.overhead_ms),
        "verify_row_ms": float(cost.verify_row_ms),
        "draft_pass": _table(cost.draft_pass),
        "verify": _table(cost.verify),
        "measured": dict(measured or {}),
    }
    text = json.dumps(document, indent=2, allow_nan=False) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp makes the file 0600; the server may run as another user: keep the old file's mode.
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_step_cost(path: str | Path) -> StepCost:
    """The StepCost of a cost file.

    A missing file raises FileNotFoundError (the caller decides on `default_step_cost`); anything
    else wrong raises ValueError naming the file and the field: not JSON, an old-format file
    (re-profile it: the message gives the command), a wrong "format", a missing or malformed
    "overhead_ms", "draft_pass" or "verify" (sizes/millis lists of finite numbers >= 0, same
    length, distinct sizes), or a "measured" that is not an object.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"cost file {path}: unreadable ({err})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"cost file {path}: not JSON ({err})") from None
    if not isinstance(document, dict):
        raise ValueError(f"cost file {path}: want a JSON object, got {type(document).__name__}")
    if "format" not in document and ({"draft_cost", "verify_cost"} & set(document)):
        raise ValueError(
            f"cost file {path}: old format (draft_cost / verify_cost: the draft stage at K drafts "
            f"by batch size), not a step cost ({FORMAT}); re-profile it: {PROFILE_COMMAND}"
        )
    if document.get("format") != FORMAT:
        raise ValueError(
            f"cost file {path}: field 'format' is {document.get('format')!r}, want {FORMAT!r}; "
            f"re-profile it: {PROFILE_COMMAND}"
        )
    overhead: Any = document.get("overhead_ms")  # checked below
    row_ms: Any = document.get("verify_row_ms", 0.0)
    for field, value in (("overhead_ms", overhead), ("verify_row_ms", row_ms)):
        if not _number(value) or not (math.isfinite(value) and value >= 0):
            raise ValueError(
                f"cost file {path}: field {field!r} must be a finite number >= 0, got {value!r}"
            )
    if not isinstance(document.get("measured", {}), dict):
        raise ValueError(f"cost file {path}: field 'measured' must be an object")
    tables = [_read_table(path, document, name) for name in TABLES]
    return StepCost(tables[0], tables[1], float(overhead), float(row_ms))


def default_step_cost(max_rows: int, max_tokens: int) -> StepCost:
    """Linear fallback when nothing was measured: a draft pass 1 ms + 0.01 ms per row, the
    target 10 ms + 0.1 ms per token, no overhead (the target ~10x the draft, as before)."""
    if max_rows < 1 or max_tokens < 1:
        raise ValueError(f"need max_rows, max_tokens >= 1; got {max_rows}, {max_tokens}")
    return StepCost.linear(1.0, 0.01, 10.0, 0.1, max_rows, max_tokens, overhead_ms=0.0)


def _table(table: CostTable) -> dict[str, list[float]]:
    sizes = [int(s) if s == int(s) else s for s in table.sizes]  # 64, not 64.0
    return {"sizes": sizes, "millis": list(table.millis)}


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _read_table(path: Path, document: dict, name: str) -> CostTable:
    data = document.get(name)
    if not isinstance(data, dict):
        raise ValueError(f"cost file {path}: field '{name}' missing or not an object")
    for key in ("sizes", "millis"):
        values = data.get(key)
        if not isinstance(values, list) or not all(_number(v) for v in values):
            raise ValueError(f"cost file {path}: field '{name}.{key}' must be a list of numbers")
    try:
        return CostTable(data["sizes"], data["millis"], name=name)
    except ValueError as err:
        raise ValueError(f"cost file {path}: field '{name}': {err}") from None
