"""Weighted isotonic regression (pool-adjacent-violators), the monotone fit of the cost tables.

`isotonic(values, weights)` returns the non-decreasing sequence f that minimises
sum_i weights[i] * (values[i] - f[i]) ** 2. Pool-adjacent-violators: scan left to right keeping
blocks of pooled points; whenever a block's weighted mean falls below the previous block's, merge
the two (and keep merging backwards while that holds). Each output value is the weighted mean of
its block, so a pooled block preserves the weighted mean of the values it replaced and an
isolated outlier is averaged with its neighbours instead of lifting every later point (which a
running max does). Pure Python: the tables have tens of points. O(n) amortised.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Non-decreasing least-squares fit of `values` (in order) with `weights` (default all 1).

    ValueError for a length mismatch, a non-finite value, or a weight that is not finite and > 0.
    An empty input gives an empty list.
    """
    ys = [float(v) for v in values]
    ws = [1.0] * len(ys) if weights is None else [float(w) for w in weights]
    if len(ws) != len(ys):
        raise ValueError(f"isotonic: {len(ys)} values but {len(ws)} weights")
    if any(not math.isfinite(y) for y in ys):
        raise ValueError("isotonic: values must be finite")
    if any(not (math.isfinite(w) and w > 0) for w in ws):
        raise ValueError("isotonic: weights must be finite and > 0")
    # Blocks as parallel stacks: weighted sum, total weight, number of points.
    sums: list[float] = []
    totals: list[float] = []
    counts: list[int] = []
    for y, w in zip(ys, ws, strict=True):
        sums.append(y * w)
        totals.append(w)
        counts.append(1)
        # Merge while the last block's mean is below the previous block's (a violation).
        while len(sums) > 1 and sums[-1] * totals[-2] < sums[-2] * totals[-1]:
            s, t, c = sums.pop(), totals.pop(), counts.pop()
            sums[-1] += s
            totals[-1] += t
            counts[-1] += c
    fitted: list[float] = []
    for s, t, c in zip(sums, totals, counts, strict=True):
        # max: the blocks' means are ordered, but s / t may round one ulp below its predecessor.
        fitted.extend([max(s / t, fitted[-1]) if fitted else s / t] * c)
    return fitted
