"""Cost tables: measured (size, milliseconds) points turned into a monotone cost curve.

Spec section 4: time the target forward at a ladder of token counts and the draft at a ladder of
batch sizes, force each curve non-decreasing, interpolate linearly, and extrapolate linearly past
the last point (with the last segment's slope). Below the first point the first value is used.

The curve is forced non-decreasing by weighted isotonic regression (avspec.av.isotonic, pool
adjacent violators), not a running max: measured medians are noisy, and a running max turns one
high outlier into a cliff under every larger size (48 -> 24.7 ms, 64 -> 53.5 ms, 80 -> 39.5 ms
made everything from 49 tokens up cost >= 53.5 ms; the fit pools 64 and 80 at 46.5 ms). The
weight of a point is how many timed repeats stand behind its median (default 1 each).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import torch

from avspec.av.isotonic import isotonic


class CostTable:
    """A non-decreasing piecewise-linear cost in ms as a function of size (tokens or requests)."""

    def __init__(
        self,
        sizes: Sequence[float],
        millis: Sequence[float],
        name: str = "cost",
        weights: Sequence[float] | None = None,
    ):
        """Points (sizes[i], millis[i]) in any order; `weights[i]` > 0: the repeats behind
        millis[i] (default 1 each). `millis` keeps the isotonic fit, not the raw values."""
        self.name = name
        sizes, millis = [float(s) for s in sizes], [float(m) for m in millis]
        if not sizes:
            raise ValueError(f"cost table {name!r} is empty")
        if len(sizes) != len(millis):
            raise ValueError(
                f"cost table {name!r}: {len(sizes)} sizes but {len(millis)} millisecond values"
            )
        for label, values in (("sizes", sizes), ("millis", millis)):
            if any(not math.isfinite(v) or v < 0 for v in values):
                raise ValueError(f"cost table {name!r}: {label} must be finite and >= 0")
        weights = [1.0] * len(sizes) if weights is None else [float(w) for w in weights]
        if len(weights) != len(sizes):
            raise ValueError(f"cost table {name!r}: {len(sizes)} sizes but {len(weights)} weights")
        if any(not (math.isfinite(w) and w > 0) for w in weights):
            raise ValueError(f"cost table {name!r}: weights must be finite and > 0")
        points = sorted(zip(sizes, millis, weights, strict=True))
        xs = [x for x, _, _ in points]
        if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
            raise ValueError(f"cost table {name!r}: duplicate sizes {xs}")
        # Measured timings are noisy; a bigger batch never costs less: the closest monotone fit.
        ys = isotonic([y for _, y, _ in points], [w for _, _, w in points])
        self.sizes: list[float] = xs
        self.millis: list[float] = ys
        self.weights: list[float] = [w for _, _, w in points]
        self._cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def linear(
        cls, fixed_ms: float, per_unit_ms: float, max_size: float, name: str = "cost"
    ) -> CostTable:
        """fixed_ms + per_unit_ms * size, as two points at 0 and max_size."""
        return cls([0.0, max_size], [fixed_ms, fixed_ms + per_unit_ms * max_size], name=name)

    def __call__(self, size: torch.Tensor | float) -> torch.Tensor:
        """Cost in ms (float32) of `size` (a tensor of any shape, or a number -> 0-dim tensor)."""
        size = torch.as_tensor(size)
        xs, ys, slopes = self._tables(size.device)
        size = size.to(torch.float64)
        segment = self._segment(xs, size)
        # take, not [segment]: indexing by a 0-dim tensor reads it on the host (a CUDA sync)
        cost = ys.take(segment) + (size - xs.take(segment)) * slopes.take(segment)
        cost = torch.where(size < xs[0], ys[0], cost)
        return cost.float()

    def at(self, size: float) -> float:
        """Cost in ms of one host-side size, in plain Python (no tensor, no device): the same
        curve as __call__, in float64, for bookkeeping off the hot path's tensors."""
        xs, ys = self.sizes, self.millis
        size = float(size)
        if len(xs) == 1 or size <= xs[0]:
            return ys[0]
        i = min(bisect.bisect_right(xs, size) - 1, len(xs) - 2)
        return ys[i] + (size - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])

    def slope(self, size: torch.Tensor | float) -> torch.Tensor:
        """Marginal ms per unit at `size` (float64): the slope of the segment `size` falls in."""
        size = torch.as_tensor(size)
        xs, _, slopes = self._tables(size.device)
        return slopes.take(self._segment(xs, size.to(torch.float64)))

    def _segment(self, xs: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
        """Index of the segment [xs[i], xs[i + 1]) each size falls in (first/last outside)."""
        index = torch.searchsorted(xs, size.contiguous(), right=True) - 1
        return index.clamp(0, max(len(self.sizes) - 2, 0))

    def _tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if device not in self._cache:
            xs = torch.tensor(self.sizes, dtype=torch.float64, device=device)
            ys = torch.tensor(self.millis, dtype=torch.float64, device=device)
            if len(self.sizes) > 1:
                slopes = (ys[1:] - ys[:-1]) / (xs[1:] - xs[:-1])
            else:
                slopes = torch.zeros(1, dtype=torch.float64, device=device)
            self._cache[device] = (xs, ys, slopes)
        return self._cache[device]

    def to_dict(self) -> dict:
        """Plain-data form (sizes and the monotone millis) for JSON.

        The fitted millis are monotone already, so from_dict rebuilds the same curve; weights
        are not kept (they only matter while fitting raw medians).
        """
        return {"name": self.name, "sizes": list(self.sizes), "millis": list(self.millis)}

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        """Inverse of to_dict (optional "weights" honoured); missing keys -> ValueError."""
        missing = {"sizes", "millis"} - set(data)
        if missing:
            raise ValueError(f"cost table dict lacks {sorted(missing)}")
        return cls(
            data["sizes"], data["millis"], name=data.get("name", "cost"),
            weights=data.get("weights"),
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"CostTable(name={self.name!r}, sizes={self.sizes}, millis={self.millis})"
