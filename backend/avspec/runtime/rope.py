"""Rotary position embeddings (Su et al. 2021, "RoFormer"): frequencies, scaling, two layouts.

A rotary embedding turns each query/key channel pair by the angle position * inv_freq[i]. The
pieces a model config chooses:

- the base `theta`: inv_freq[i] = theta ** (-2i / head_dim), i < head_dim / 2;
- an optional `RopeScaling` of the frequencies: `linear` divides every frequency by `factor`;
  `llama3` (Llama 3.1) divides the low frequencies (wavelength above
  original_max_position_embeddings / low_freq_factor) by `factor`, keeps the high ones
  (wavelength below original_max_position_embeddings / high_freq_factor) and interpolates in
  between, smoothly in original_max_position_embeddings / wavelength;
- the layout of the pairs: `half` turns channels (i, i + head_dim/2) (GPT-NeoX, Llama's
  rotate_half, and the project's own models), `interleaved` turns (2i, 2i + 1) (GPT-J).

Angles are computed in float64 and tabulated per position up to the model's `max_length`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

ROPE_STYLES = ("half", "interleaved")
SCALING_KINDS = ("linear", "llama3")
_LLAMA3_FIELDS = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class RopeScaling:
    """Frequency scaling: `kind` "linear" (factor only) or "llama3" (all fields)."""

    kind: str
    factor: float
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in SCALING_KINDS:
            raise ValueError(f"RopeScaling.kind must be one of {SCALING_KINDS}, got {self.kind!r}")
        object.__setattr__(self, "factor", _positive_float("factor", self.factor))
        given = [name for name in _LLAMA3_FIELDS if getattr(self, name) is not None]
        if self.kind == "linear":
            if given:
                raise ValueError(f"linear RoPE scaling takes only a factor, got {given}")
            return
        missing = [name for name in _LLAMA3_FIELDS if name not in given]
        if missing:
            raise ValueError(f"llama3 RoPE scaling needs {missing}")
        low = _positive_float("low_freq_factor", self.low_freq_factor)
        high = _positive_float("high_freq_factor", self.high_freq_factor)
        if high <= low:
            raise ValueError(
                f"llama3 RoPE scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}"
            )
        original = self.original_max_position_embeddings
        if not isinstance(original, int) or isinstance(original, bool) or original < 1:
            raise ValueError(
                f"RopeScaling.original_max_position_embeddings must be a positive int, "
                f"got {original!r}"
            )
        object.__setattr__(self, "low_freq_factor", low)
        object.__setattr__(self, "high_freq_factor", high)

    @classmethod
    def from_dict(cls, data: object) -> RopeScaling:
        """Build from `to_dict`'s dict; ValueError on a non-dict or unknown keys."""
        if isinstance(data, RopeScaling):
            return data
        if not isinstance(data, dict):
            raise ValueError(f"rope_scaling must be a JSON object or null, got {data!r}")
        known = {"kind", "factor", *_LLAMA3_FIELDS}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown rope_scaling keys: {unknown}")
        try:
            return cls(**data)
        except TypeError as err:
            raise ValueError(f"bad rope_scaling: {err}") from None


def _positive_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ValueError(f"RoPE {name} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"RoPE {name} must be finite, got {value!r}")
    return float(value)


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> Tensor:
    """Per-pair angular frequencies [head_dim / 2], float64 on the CPU."""
    pairs = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = theta ** (-pairs / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: the three bands of wavelength described in the module docstring
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    original = scaling.original_max_position_embeddings
    assert low is not None and high is not None and original is not None  # checked by llama3
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """Rotate query/key channel pairs by position-dependent angles (tables up to max_length)."""

    cos: Tensor  # buffers [max_length, head_dim / 2]
    sin: Tensor

    def __init__(
        self,
        head_dim: int,
        max_length: int,
        theta: float,
        scaling: RopeScaling | None = None,
        style: str = "half",
    ) -> None:
        super().__init__()
        if style not in ROPE_STYLES:
            raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
        self.head_dim, self.max_length = head_dim, max_length
        self.theta, self.scaling, self.style = theta, scaling, style
        # (position, head_dim / 2); not saved: recomputed from the config
        self.register_buffer("cos", torch.empty(max_length, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_length, head_dim // 2), persistent=False)
        self.reset()

    def reset(self) -> None:
        """(Re)compute the tables in place: on construction, and after `Module.to_empty`."""
        if self.cos.is_meta:
            return  # a model built on the meta device gets its tables after to_empty
        inv_freq = inverse_frequencies(self.head_dim, self.theta, self.scaling)
        positions = torch.arange(self.max_length, dtype=torch.float64, device="cpu")
        angles = torch.outer(positions, inv_freq)
        with torch.no_grad():
            self.cos.copy_(angles.cos().float())
            self.sin.copy_(angles.sin().float())

    def forward(self, x: Tensor, positions: Tensor) -> Tensor:
        """x: [..., seq, heads, head_dim] with `positions` [seq] or x: [tokens, heads, head_dim]
        with `positions` [tokens]."""
        return self.rotate(x, self.angles(positions, x.dtype))

    def angles(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """(cos, sin) at `positions` [n] in `dtype`, each [n, 1, head_dim / 2]: looked up once
        per step, used by every layer's `rotate`."""
        return (
            self.cos[positions].unsqueeze(-2).to(dtype),
            self.sin[positions].unsqueeze(-2).to(dtype),
        )

    def rotate(self, x: Tensor, angles: tuple[Tensor, Tensor]) -> Tensor:
        """x: [..., n, heads, head_dim] turned by `angles` (from `angles`, for those n)."""
        cos, sin = angles
        if self.style == "half":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
