"""Temperature / top-p warping of logits into probabilities, and seeded per-request sampling.

The draft and the target apply the SAME warp. Rejection sampling (avspec.engine.rejection) is exact
with respect to the distribution it is given as p, so the tokens it emits are distributed as the
target's warped distribution: exactly what the target alone would sample with these settings.

Sampling uses the exponential race: argmax_x p(x) / E_x with E_x ~ Exp(1) i.i.d. picks x with
probability p(x). It consumes exactly `vocab` exponentials per draw, whatever p is, so a request's
random stream never depends on its distribution or on the rest of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avspec.checks import check_finite, check_same_device, check_shape


def warp_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """Turn logits [batch, position, vocab] into warped probabilities [batch, position, vocab] fp32.

    temperature [batch] (0 = greedy: one-hot on the argmax, ties to the lowest token id), top_p
    [batch] in (0, 1]: keep the smallest set of most probable tokens whose mass >= top_p (the top
    token always), renormalise. -inf logits are masked tokens. `check_values` validates the
    temperature / top_p ranges and logits finiteness (a host sync on CUDA).
    """
    check_shape("logits", logits, (None, None, None))
    batch, _, vocab = logits.shape
    check_shape("temperature", temperature, (batch,))
    check_shape("top_p", top_p, (batch,))
    check_same_device(logits=logits, temperature=temperature, top_p=top_p)
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocab dimension")
    if check_values:
        _check_warp_values(logits, temperature, top_p)
    logits = logits.float()
    greedy = (temperature == 0)[:, None, None]  # [batch, 1, 1]
    scale = torch.where(temperature > 0, temperature.float(), torch.ones_like(temperature.float()))
    probs = torch.softmax(logits / scale[:, None, None], dim=-1)
    probs = _top_p_filter(probs, top_p.float()[:, None, None])
    return torch.where(greedy, _one_hot_argmax(logits), probs)


def _check_warp_values(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> None:
    check_finite("logits", logits)
    check_finite("temperature", temperature)
    check_finite("top_p", top_p)
    if bool((temperature < 0).any()):
        raise ValueError("temperature must be >= 0")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError("top_p must lie in (0, 1]")
    if logits.numel() and bool((logits == float("-inf")).all(dim=-1).any()):
        raise ValueError("logits has a row where every token is masked (-inf)")


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside the nucleus of probs [batch, position, vocab]; renormalise."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    # Mass strictly before a token < top_p: the smallest prefix reaching top_p, top token always.
    keep_sorted = mass_before < top_p
    keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
    kept = torch.where(keep, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot [batch, position, vocab] fp32 on the argmax; ties to the lowest token id."""
    vocab = logits.shape[-1]
    ids = torch.arange(vocab, device=logits.device)
    is_max = logits == logits.max(dim=-1, keepdim=True).values
    first = torch.where(is_max, ids, vocab).min(dim=-1, keepdim=True).values
    return (ids == first).float()


def exponential_noise(
    generators: Sequence[torch.Generator], shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Draw Exp(1) noise [batch, *shape], row r from generators[r] only (host loop over batch)."""
    rows = [
        torch.empty(tuple(shape), device=device).exponential_(generator=gen) for gen in generators
    ]
    if not rows:
        return torch.empty((0, *shape), device=device)
    # Exp(1) can round to 0; a tiny floor keeps p / E finite without changing the race.
    return torch.stack(rows).clamp_min(torch.finfo(torch.float32).tiny)


def race(probs: torch.Tensor, exponentials: torch.Tensor) -> torch.Tensor:
    """Exponential race: argmax over vocab of probs / exponentials ([..., vocab] -> [...] int64)."""
    return torch.argmax(probs / exponentials, dim=-1)


def check_generators(
    name: str, generators: Sequence[torch.Generator], batch: int, device: torch.device
) -> None:
    """Raise ValueError unless `generators` holds `batch` torch.Generators on `device`."""
    if len(generators) != batch:
        raise ValueError(
            f"{name} must hold one generator per request ({batch}), got {len(generators)}"
        )
    for gen in generators:
        if not isinstance(gen, torch.Generator):
            raise ValueError(f"{name} must hold torch.Generator objects, got {type(gen).__name__}")
        if torch.device(gen.device).type != device.type:
            raise ValueError(f"{name}: generator on {gen.device}, tensors on {device}")


def sample(
    probs: torch.Tensor, generators: Sequence[torch.Generator], *, check_values: bool = True
) -> torch.Tensor:
    """Draw one token per row of probs [batch, vocab] -> tokens [batch] int64.

    Row r uses only generators[r] (vocab exponentials per call), so a request's draws never depend
    on which other requests share the batch.
    """
    check_shape("probs", probs, (None, None))
    batch, vocab = probs.shape
    check_generators("generators", generators, batch, probs.device)
    if vocab == 0:
        raise ValueError("probs must have a non-empty vocab dimension")
    if check_values:
        check_finite("probs", probs)
        if bool((probs < 0).any()) or bool((probs.sum(dim=-1) <= 0).any()):
            raise ValueError("probs must be non-negative with a positive sum per row")
    noise = exponential_noise(generators, (vocab,), probs.device)
    return race(probs.float(), noise)
