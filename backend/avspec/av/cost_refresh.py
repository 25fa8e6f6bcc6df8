"""Online refresh of a StepCost from the step times the server measures.

The profiled tables describe the machine they were measured on, at the time they were measured.
`CostRefresh` follows the machine the deployment runs on: for every served step it is told the
rows and milliseconds of each draft pass, the tokens and milliseconds of the target, and the
step's wall milliseconds, and every `every` steps it rewrites the StepCost in place:

- each observation of a table (the draft's pass over pending inputs: pending_pass; a further
  draft pass: draft_pass; the target forward: verify) gives a ratio
  observed ms / PROFILED ms at its size (for the target: its table at the tokens plus
  verify_row_ms times its rows) and joins the window (the last `window` ratios) of the
  nearest ladder size of that table (absolute distance, ties to the smaller size); an
  observation past the table's largest size is left out: its ratio measures how wrong the
  profiled extrapolation is there (a prefill of 2,230 tokens served in 3.3 s against 0.6 s
  extrapolated from a ladder ending at 576), and it would rescale the last point by that;
- a step right after one whose draft ran no pass (pass 0 of 0 ms: it deferred its inputs, see
  avspec.engine.draft_stage) is left out whole: its pass 0 ran those inputs too, more tokens
  than its rows say;
- the new table is the profiled one with each ladder point scaled by the median ratio of its
  window (a point with no ratios: the median of all the table's ratios; a table with none at all
  is left as it is), refitted isotonically with each point weighted by its number of ratios;
  verify_row_ms is the profiled one scaled by the median of all the target's ratios;
- the rest of each step, step ms - draft ms - target ms, is fitted over the last `window` steps
  as overhead_ms + probs_row_ms * rows * width (avspec.av.step_cost: the draft probabilities'
  hop, width from the deepest pass run): probs_row_ms is the Theil-Sen slope (the median of the
  pairwise slopes, at most 1,000 steps, evenly picked) clamped at 0, kept as it was while every
  step of the window has the same rows * width; overhead_ms the median of the rest less the hop,
  clamped at 0. Steps without a wall time do not count.

Medians make one stalled step irrelevant, ratios against the profiled table keep the measured
shape (a machine that gets uniformly slower keeps its curve, only scaled), and the window bounds
how long a change takes to be followed: at most window // 2 + 1 observations at a ladder point
plus `every` steps. The StepCost object is the one the plan holds: new CostTables are assigned to
cost.draft_pass, cost.pending_pass and cost.verify (a reference swap each; no tensor is written
in place). The pending pass is profiled as a draft pass (its table None in the StepCost): its
ratios are taken to the profiled draft-pass table and kept apart from the decode passes' (served
it costs more, see avspec.av.step_cost); until it has a ratio it stays None, priced by the
refreshed draft-pass table.

`observe` and the refresh work on host numbers only (Python and numpy: no tensor, no device
sync). Call `observe` from the thread that plans steps, or accept that a plan may see a new draft
table with the old verify table for one step.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost, draft_width

TABLES = ("draft_pass", "pending_pass", "verify")


class CostRefresh:
    """Windowed median ratios of served / profiled step times, folded back into a StepCost."""

    def __init__(self, cost: StepCost, enabled: bool = True, window: int = 64, every: int = 16):
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an integer >= 1, got {window!r}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1, got {every!r}")
        self.cost = cost
        self.enabled = bool(enabled)
        self.window = window
        self.every = every
        # The tables as measured (the CostTables are never modified): ratios are taken to them.
        self.profiled = StepCost(
            cost.draft_pass,
            cost.verify,
            cost.overhead_ms,
            cost.verify_row_ms,
            cost.first_pass,
            cost.probs_row_ms,
        )
        self.steps = 0  # steps observed (enabled, valid)
        self.updates = 0  # refreshes that changed the StepCost
        self._ratios: dict[str, list[deque[float]]] = {
            name: [deque(maxlen=window) for _ in self._profiled(name).sizes] for name in TABLES
        }
        # (rows * width of the draft probabilities, step ms outside the stages) per step
        self._overheads: deque[tuple[float, float]] = deque(maxlen=window)
        self._deferred = False  # the last observed step's draft ran no pass
        # (predicted by the cost in force, predicted by the profiled cost, observed) step ms.
        self._steps: deque[tuple[float, float, float]] = deque(maxlen=window)

    def observe(
        self,
        draft_rows: Sequence[int],
        draft_ms: Sequence[float],
        verify_tokens: int,
        verify_ms: float,
        step_ms: float | None,
        verify_rows: int = 0,
    ) -> None:
        """One served step; a no-op when disabled.

        draft_rows[p], draft_ms[p]: rows and ms of draft pass p (pass 0: the tokens of the
        pending-input pass; a pass with 0 rows or 0 ms was not run and is skipped; the step
        after one whose pass 0 did not run is skipped whole, see the module doc). verify_tokens,
        verify_ms: the target forward; verify_rows: the rows it ran (0: the per-row term is
        left out). step_ms: the step's wall ms as the scheduler measured it,
        or None. ValueError naming the field for a negative or non-finite value, a fractional
        row or token count, or draft_rows and draft_ms of different lengths; nothing is
        recorded then.
        """
        if not self.enabled:
            return
        rows = [_count("draft_rows", r) for r in draft_rows]
        millis = [_millis("draft_ms", m) for m in draft_ms]
        if len(rows) != len(millis):
            raise ValueError(f"draft_rows has {len(rows)} passes but draft_ms has {len(millis)}")
        tokens = _count("verify_tokens", verify_tokens)
        verify_rows = _count("verify_rows", verify_rows)
        target_ms = _millis("verify_ms", verify_ms)
        wall = None if step_ms is None else _millis("step_ms", step_ms)
        catching_up = self._deferred and bool(millis) and millis[0] > 0
        self._deferred = bool(millis) and millis[0] == 0
        if catching_up:
            return

        for p, (size, ms) in enumerate(zip(rows, millis, strict=True)):
            if size > 0 and ms > 0:  # 0 ms: the pass was not run (or not timed)
                self._add("draft_pass" if p else "pending_pass", size, ms)
        if tokens > 0:
            self._add("verify", tokens, target_ms, self.profiled.verify_row_ms * verify_rows)
        if wall is not None:
            hop = float(verify_rows * draft_width(rows))
            self._overheads.append((hop, wall - sum(millis) - target_ms))
            self._steps.append(
                (
                    self.cost.step_ms(rows, tokens, verify_rows),
                    self.profiled.step_ms(rows, tokens, verify_rows),
                    wall,
                )
            )
        self.steps += 1
        if self.steps % self.every == 0:
            self._refresh()

    def refresh_now(self) -> None:
        """Rewrite the StepCost from the window now, as every `every` steps does (replays fit
        a cost to a whole recording this way: a window and `every` longer than it)."""
        self._refresh()

    def report(self) -> dict[str, Any]:
        """Predicted vs observed step ms over the window (None where there is no data).

        predicted_step_ms / observed_step_ms: medians over the last `window` steps with a wall
        time, predicted by the cost in force at each step; relative_error: (predicted - observed)
        / observed of those medians; median_abs_relative_error: median of |predicted - observed| /
        observed per step; profiled_*: the same for the tables as profiled (no refresh).
        """
        out: dict[str, Any] = {
            "enabled": self.enabled,
            "steps": self.steps,
            "updates": self.updates,
            "window_steps": len(self._steps),
            "overhead_ms": self.cost.overhead_ms,
            "observed_step_ms": None,
            "predicted_step_ms": None,
            "relative_error": None,
            "median_abs_relative_error": None,
            "profiled_predicted_step_ms": None,
            "profiled_relative_error": None,
            "profiled_median_abs_relative_error": None,
        }
        timed = [s for s in self._steps if s[2] > 0]
        if not timed:
            return out
        observed = statistics.median(s[2] for s in timed)
        out["observed_step_ms"] = observed
        for prefix, index in (("", 0), ("profiled_", 1)):
            predicted = statistics.median(s[index] for s in timed)
            out[f"{prefix}predicted_step_ms"] = predicted
            out[f"{prefix}relative_error"] = (predicted - observed) / observed
            out[f"{prefix}median_abs_relative_error"] = statistics.median(
                abs(s[index] - s[2]) / s[2] for s in timed
            )
        return out

    def _add(self, name: str, size: int, ms: float, extra_ms: float = 0.0) -> None:
        profiled = self._profiled(name)
        if size > profiled.sizes[-1]:
            return  # past the ladder (see the module doc)
        predicted = profiled.at(size) + extra_ms
        if predicted <= 0.0:
            return  # a free point has no ratio
        self._ratios[name][_nearest(profiled.sizes, float(size))].append(ms / predicted)

    def _profiled(self, name: str) -> CostTable:
        """The table `name` as profiled (`self.profiled` always holds a pending pass)."""
        table: CostTable = getattr(self.profiled, name)
        return table

    def _refresh(self) -> None:
        changed = False
        for name in TABLES:
            windows = self._ratios[name]
            every_ratio = [r for w in windows for r in w]
            if not every_ratio:
                continue
            overall = statistics.median(every_ratio)
            profiled = self._profiled(name)
            scaled = [
                ms * (statistics.median(w) if w else overall)
                for ms, w in zip(profiled.millis, windows, strict=True)
            ]
            weights = [max(1, len(w)) for w in windows]
            setattr(self.cost, name, CostTable(profiled.sizes, scaled, name, weights))
            if name == "verify":
                self.cost.verify_row_ms = self.profiled.verify_row_ms * overall
            changed = True
        if self._overheads:
            slope = _hop_slope(self._overheads)
            if slope is not None:
                self.cost.probs_row_ms = slope
            rest = [ms - self.cost.probs_row_ms * hop for hop, ms in self._overheads]
            self.cost.overhead_ms = max(0.0, float(statistics.median(rest)))
            changed = True
        if changed:
            self.updates += 1


def _hop_slope(points: Sequence[tuple[float, float]], most: int = 1000) -> float | None:
    """Theil-Sen slope of (x, ms) points, clamped at 0; None when every x is the same."""
    x = np.array([p[0] for p in points], dtype=np.float64)
    ms = np.array([p[1] for p in points], dtype=np.float64)
    if len(x) > most:
        pick = np.linspace(0, len(x) - 1, most).astype(np.int64)
        x, ms = x[pick], ms[pick]
    first, second = np.triu_indices(len(x), 1)
    dx = x[second] - x[first]
    differ = dx != 0
    if not differ.any():
        return None
    slopes = (ms[second] - ms[first])[differ] / dx[differ]
    return max(0.0, float(np.median(slopes)))


def _nearest(sizes: list[float], size: float) -> int:
    """Index of the ladder size nearest to `size` (ties: the smaller)."""
    i = bisect.bisect_left(sizes, size)
    if i == 0:
        return 0
    if i == len(sizes):
        return len(sizes) - 1
    return i if sizes[i] - size < size - sizes[i - 1] else i - 1


def _millis(field: str, value: Any) -> float:
    try:
        ms = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number, got {value!r}") from None
    if not (math.isfinite(ms) and ms >= 0.0):
        raise ValueError(f"{field} must be finite and >= 0, got {value!r}")
    return ms


def _count(field: str, value: Any) -> int:
    count = _millis(field, value)
    if count != int(count):
        raise ValueError(f"{field} must be a whole number, got {value!r}")
    return int(count)
