"""The served step log: what the verifier saw and chose at every decode step, one JSON line each.

Off by default (the verifier's `step_log` parameter names the file). Replays read it
(avspec.tools.bench.replay): they rerun the budget and the drafting plan over the recorded
features, so a line holds everything the verifier's decision depended on, plus the outcome of
the step before:

    t                  wall-clock seconds (time.time()) when the step was decided
    ids                [batch] sequence ids, in batch order
    caps               [batch] num_draft_tokens
    drafted            [batch] drafts each row drafted (<= caps)
    adaptive           [batch] 0/1, AV on for the row
    features           [batch][drafted] logit(q_max) of each drafted position (4 decimals)
    verify             [batch] num_verify, the verifier's choice
    budget             drafts admitted among adaptive rows (an upper bound)
    base               tokens the target runs besides the admitted drafts (prefill included)
    prev_accepted      [prev_batch] outcome of the previous line's rows (-1: unlabelled)
    timing             the previous step's [draft ms per pass (K), target ms, step wall ms]

A write failure (disk full, permissions) is logged once and turns the log off: the log never
fails a step. `read_step_log` skips a torn last line (a server killed mid-write).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from pathlib import Path
from typing import IO, Any

import torch

from avspec.contract import VerifierInputs

logger = logging.getLogger(__name__)


class StepLog:
    """Appends one line per verifier step to `path` (created with its parent directory)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = None
        self.num_lines = 0
        self.off = False  # set by a write failure

    def append(self, inputs: VerifierInputs, num_verify: torch.Tensor, budget: int) -> None:
        """Record one step (host copies of its tensors); an empty batch is not recorded."""
        if inputs.seq_ids.numel() == 0 or self.off:
            return
        drafted = inputs.num_drafted if inputs.num_drafted is not None else inputs.num_draft_tokens
        drafted_list = [int(d) for d in drafted.cpu().tolist()]
        features = inputs.features.detach().float().cpu().tolist()
        timing = inputs.prev_timing_ms
        line = {
            "t": round(time.time(), 6),
            "ids": [int(i) for i in inputs.seq_ids.cpu().tolist()],
            "caps": [int(c) for c in inputs.num_draft_tokens.cpu().tolist()],
            "drafted": drafted_list,
            "adaptive": [int(a) for a in inputs.adaptive.cpu().tolist()],
            "features": [
                [round(x, 4) for x in row[:d]]
                for row, d in zip(features, drafted_list, strict=True)
            ],
            "verify": [int(v) for v in num_verify.cpu().tolist()],
            "budget": int(budget),
            "base": int(inputs.base_tokens),
            "prev_accepted": [int(a) for a in inputs.prev_num_accepted.cpu().tolist()],
            "timing": [] if timing is None else [round(float(x), 4) for x in timing.tolist()],
        }
        self._write(json.dumps(line, separators=(",", ":")) + "\n")

    def _write(self, text: str) -> None:
        try:
            if self._file is None:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._file = self.path.open("a", encoding="utf-8")
            self._file.write(text)
            self._file.flush()
            self.num_lines += 1
        except OSError as err:
            logger.warning("step log %s: %s; the step log is off from now on", self.path, err)
            self.close()
            self.off = True

    def close(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def logged_accepted(outcome: int) -> int:
    """Accepted drafts of one `prev_accepted` entry (a row kept from the refit logs a as -1 - a,
    avspec.av.estimator.refit_excluded)."""
    return outcome if outcome >= 0 else -1 - outcome


def read_step_log(
    path: Path, start: float = -float("inf"), end: float = float("inf")
) -> list[dict[str, Any]]:
    """The lines of a step log with `start` <= t < `end`, in order; a torn line is skipped."""
    lines: list[dict[str, Any]] = []
    with path.open(encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except json.JSONDecodeError:
                continue
            if start <= line["t"] < end:
                lines.append(line)
    return lines
