"""The cost-ratio section of a model card: a cost-tables file's figures, when they are this pair's.

A cost file (`avspec.av.cost_file`) names the pair it was measured on only by directories and a
date; `cost_pair` decides from the weights and their times whether that is the pair on the card,
and `cost_section` reports the file's provenance and, only then, its figures.
"""

from __future__ import annotations

import hashlib
import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from avspec.av.cost_file import load_step_cost
from avspec.tools.train.draft.card_measure import DEPTH

COST_ROWS = (1, 64)


def _weights(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    """Whether two model directories are one (same path) or hold byte-identical weights."""
    if a.resolve() == b.resolve():
        return True
    files_a, files_b = _weights(a), _weights(b)
    if [f.name for f in files_a] != [f.name for f in files_b] or not files_a:
        return False
    for x, y in zip(files_a, files_b, strict=True):
        if x.stat().st_size != y.stat().st_size:
            return False
        digests = [hashlib.sha256(f.read_bytes()).digest() for f in (x, y)]
        if digests[0] != digests[1]:
            return False
    return True


def cost_pair(measured: dict, target_dir: Path, draft_dir: Path) -> tuple[bool, str]:
    """Whether a cost file's `measured` block says it was measured on this pair, and why not.

    The file names its pair only by directories ("T + D (dtype)", client/profile_costs.py,
    relative to where it ran) and the date. It is this pair's when the named directories hold
    this pair's weights (`same_weights`) and were last written before the measurement (a file
    measured before other weights were moved to the same paths is another pair's)."""
    models = measured.get("models")
    if not isinstance(models, str):
        return False, "the file does not say which pair it was measured on"
    named = re.match(r"(\S+) \+ (\S+)", models)
    if named is None:
        return False, f"the file was measured on {models}"
    pairs = list(zip(map(Path, named.groups()), (target_dir, draft_dir), strict=True))
    for theirs, ours in pairs:
        if not theirs.is_dir():
            return False, f"the file was measured on {models}; {theirs} is not here to compare"
        if not same_weights(theirs, ours):
            return False, f"the file was measured on {models}: {theirs} is not {ours}"
    try:
        date = datetime.fromisoformat(str(measured.get("date"))).timestamp()
    except ValueError:
        return False, f"the file names {models} but not when it was measured"
    for theirs, _ in pairs:
        written = max((f.stat().st_mtime for f in _weights(theirs)), default=0.0)
        if written > date:
            when = datetime.fromtimestamp(written, UTC).isoformat(timespec="seconds")
            return False, (
                f"the file names {models} but was measured {measured['date']}, before the "
                f"weights in {theirs} were written ({when}): another pair at those paths"
            )
    return True, f"measured on {models}, {measured['date']}, the same weights as this pair"


def cost_section(path: Path | str, target_dir: Path, draft_dir: Path) -> dict[str, Any]:
    """The cost file's provenance and, when it is this pair's (`cost_pair`), at each of
    COST_ROWS rows: a draft pass, a target step of one token per row (`verify_ms`, without the
    per-step overhead), their ratio, and `verify_to_draft_ratio` at DEPTH drafts."""
    path = Path(path)
    cost = load_step_cost(path)
    measured = json.loads(path.read_text(encoding="utf-8")).get("measured", {})
    ours, why = cost_pair(measured, target_dir, draft_dir)
    section: dict[str, Any] = {
        "file": str(path),
        "this_pair": ours,
        "why": why,
        "provenance": {k: measured.get(k) for k in ("models", "date", "device", "command")},
    }
    if ours:
        section["rows"] = [
            {"rows": r, "draft_pass_ms": cost.draft_pass.at(r),
             "target_step_ms": cost.verify_ms(r, r),
             "ratio": cost.verify_ms(r, r) / cost.draft_pass.at(r),
             "verify_to_draft_ratio": cost.verify_to_draft_ratio(r, DEPTH)}
            for r in COST_ROWS
        ]  # fmt: skip
    return section
