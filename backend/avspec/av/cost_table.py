"""Cost tables: measured (size, milliseconds) points turned into a monotone cost curve.

Spec section 4: time the target forward at a ladder of token counts and the draft at a ladder of
batch sizes, force each curve non-decreasing, interpolate linearly, and extrapolate linearly past
the last point (with the last segment's slope). Below the first point the first value is used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class CostTable:
    """A non-decreasing piecewise-linear cost in ms as a function of size (tokens or requests)."""

    def __init__(self, sizes: Sequence[float], millis: Sequence[float], name: str = "cost"):
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
        points = sorted(zip(sizes, millis, strict=True))
        xs = [x for x, _ in points]
        if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
            raise ValueError(f"cost table {name!r}: duplicate sizes {xs}")
        ys, running = [], 0.0
        for _, y in points:
            # Measured timings are noisy; a bigger batch never costs less.
            running = max(running, y)
            ys.append(running)
        self.sizes: list[float] = xs
        self.millis: list[float] = ys
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
        segment = (torch.searchsorted(xs, size.contiguous(), right=True) - 1).clamp(
            0, max(len(self.sizes) - 2, 0)
        )
        cost = ys[segment] + (size - xs[segment]) * slopes[segment]
        cost = torch.where(size < xs[0], ys[0], cost)
        return cost.float()

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
        """Plain-data form (sizes and the monotone millis) for JSON."""
        return {"name": self.name, "sizes": list(self.sizes), "millis": list(self.millis)}

    @classmethod
    def from_dict(cls, data: dict) -> CostTable:
        """Inverse of to_dict; missing keys -> ValueError."""
        missing = {"sizes", "millis"} - set(data)
        if missing:
            raise ValueError(f"cost table dict lacks {sorted(missing)}")
        return cls(data["sizes"], data["millis"], name=data.get("name", "cost"))

    def __repr__(self) -> str:
        return f"CostTable(name={self.name!r}, sizes={self.sizes}, millis={self.millis})"
