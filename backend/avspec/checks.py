"""Input validation shared by every public entry point: one clear ValueError per problem."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_shape(name: str, tensor: torch.Tensor, shape: Sequence[int | None]) -> None:
    """Raise ValueError unless `tensor` has len(shape) dims matching `shape` (None = any size)."""
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != len(shape) or any(
        want is not None and got != want for got, want in zip(tensor.shape, shape, strict=True)
    ):
        dims = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must have shape ({dims}), got {tuple(tensor.shape)}")


def check_same_device(**tensors: torch.Tensor) -> torch.device:
    """Raise ValueError unless all tensors live on one device; return that device."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise ValueError(f"tensors must share one device: {listing}")
    return next(iter(devices.values()))


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Raise ValueError if `tensor` holds NaN or +-inf (-inf is allowed: masked logits)."""
    bad = torch.isnan(tensor) | (tensor == float("inf"))
    if bool(bad.any()):
        raise ValueError(f"{name} contains NaN or +inf")
