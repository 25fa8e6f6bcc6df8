"""Temperature / top-p warping of logits into probabilities, and seeded per-request sampling.

The draft and the target apply the SAME warp. Rejection sampling (avspec.engine.rejection) is exact
with respect to the distribution it is given as p, so the tokens it emits are distributed as the
target's warped distribution: exactly what the target alone would sample with these settings.

Sampling inverts the cumulative distribution: with U ~ Uniform[0, 1) the first token x whose
running mass exceeds U x (total mass) has probability p(x) (a token of zero mass is never
chosen). A draw consumes exactly one fp64 uniform from the request's own generator, whatever p
is, so a request's random stream never depends on its distribution or on the rest of the batch.
(The exponential race used before drew `vocab` exponentials per draw: a quarter of a 64-row
draft pass on the CPU over a 4096-piece vocabulary.)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from avspec.checks import check_finite, check_same_device, check_shape
from avspec.engine.top_p import top_p_filter


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
    arguments (shapes, devices, temperature / top_p ranges, logits finiteness: a host sync on
    CUDA); the stages pass False, their inputs checked once where the step enters a stage.
    """
    if check_values:
        _check_warp_arguments(logits, temperature, top_p)
    logits = logits.float()
    greedy = (temperature == 0)[:, None, None]  # [batch, 1, 1]
    if logits.device.type == "cpu" and bool(greedy.all()):
        return _one_hot_argmax(logits)  # the softmax and nucleus would go unused
    scale = _scale(temperature)[:, None, None]
    on_cpu_at_one = logits.device.type == "cpu" and bool((scale == 1).all())
    probs = torch.softmax(logits if on_cpu_at_one else logits / scale, dim=-1)  # x / 1 == x
    probs = top_p_filter(probs, top_p.float()[:, None, None])
    if probs.device.type == "cpu" and not bool(greedy.any()):
        return probs  # the one-hot argmax costs ~10 % of a CPU draft pass; skip it when unused
    return torch.where(greedy, _one_hot_argmax(logits), probs)


def draft_warp(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: int,
    *,
    check_values: bool = True,
) -> torch.Tensor:
    """The draft's q: `warp_probs` restricted to the `top_k` most probable tokens (0 or >= vocab:
    `warp_probs` itself). logits [batch, 1, vocab] -> probs [batch, 1, vocab] fp32.

    Temperature, then the top_k tokens, then top-p within them (order among equal logits as
    `torch.topk` gives it), renormalised; greedy rows as in `warp_probs`. Exactness does not
    need the draft to warp like the target: rejection sampling is exact for any q the drafts
    were really sampled from, so this only trades acceptance (mass beyond top_k is never
    drafted) for a draft pass that sorts top_k values instead of a long nucleus.
    """
    vocab = logits.shape[-1]
    if top_k <= 0 or top_k >= vocab:
        return warp_probs(logits, temperature, top_p, check_values=check_values)
    if check_values:
        check_shape("logits", logits, (None, 1, None))
        _check_warp_arguments(logits, temperature, top_p)
    logits = logits.float()
    values, index = torch.topk(logits, top_k, dim=-1)  # [batch, 1, top_k], descending
    greedy = (temperature == 0)[:, None, None]
    probs = torch.softmax(values / _scale(temperature)[:, None, None], dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    kept = torch.where(mass_before < top_p.float()[:, None, None], probs, torch.zeros_like(probs))
    first = torch.arange(top_k, device=logits.device) == 0  # topk's first: an argmax
    kept = torch.where(greedy, first.to(kept), kept)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(logits).scatter_(-1, index, kept)


def _scale(temperature: torch.Tensor) -> torch.Tensor:
    """The logits' divisor [batch]: the temperature, 1 for greedy rows (their softmax is unused)."""
    temperature = temperature.float()
    return torch.where(temperature > 0, temperature, torch.ones_like(temperature))


def _check_warp_arguments(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> None:
    check_shape("logits", logits, (None, None, None))
    batch, _, vocab = logits.shape
    check_shape("temperature", temperature, (batch,))
    check_shape("top_p", top_p, (batch,))
    check_same_device(logits=logits, temperature=temperature, top_p=top_p)
    if vocab == 0:
        raise ValueError("logits must have a non-empty vocab dimension")
    check_finite("temperature", temperature)
    check_finite("top_p", top_p)
    if bool((temperature < 0).any()):
        raise ValueError("temperature must be >= 0")
    if bool(((top_p <= 0) | (top_p > 1)).any()):
        raise ValueError("top_p must lie in (0, 1]")
    # one pass for the common case: a row's max is finite unless the row holds NaN (max
    # propagates it), +inf, or nothing but -inf; only then are the entries themselves read
    if logits.numel() and not bool(torch.isfinite(logits.amax(dim=-1)).all()):
        check_finite("logits", logits)
        raise ValueError("logits has a row where every token is masked (-inf)")


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    """One-hot [batch, position, vocab] fp32 on the argmax; ties to the lowest token id."""
    vocab = logits.shape[-1]
    ids = torch.arange(vocab, device=logits.device)
    is_max = logits == logits.max(dim=-1, keepdim=True).values
    first = torch.where(is_max, ids, vocab).min(dim=-1, keepdim=True).values
    return (ids == first).float()


def uniform_noise(
    generators: Sequence[torch.Generator], shape: Sequence[int], device: torch.device
) -> torch.Tensor:
    """Draw fp64 Uniform[0, 1) noise [batch, *shape], row r from generators[r] only (host loop
    over batch)."""
    rows = [
        torch.rand(tuple(shape), device=device, dtype=torch.float64, generator=gen)
        for gen in generators
    ]
    if not rows:
        return torch.empty((0, *shape), device=device, dtype=torch.float64)
    return torch.stack(rows)


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row of probs [..., vocab] (non-negative, positive sum) for uniforms [...]
    in [0, 1): the first token whose running mass (fp64) exceeds uniform x total -> [...] int64.
    A token of zero mass is never the first to exceed it; should rounding put the point past the
    last running sum, the last token of positive mass is taken."""
    cumulative = torch.cumsum(probs.double(), dim=-1)
    point = (uniforms * cumulative[..., -1])[..., None]
    token = torch.searchsorted(cumulative, point, right=True)[..., 0]
    if probs.device.type == "cpu":
        # the CPU sums in order, so adding a zero mass leaves the running sum exactly as it
        # was: a token found has positive mass, and only a point past the end (rare) needs the
        # last one of positive mass
        over = token == probs.shape[-1]
        return torch.where(over, _last_positive(probs), token) if bool(over.any()) else token
    return torch.minimum(token, _last_positive(probs))


def _last_positive(probs: torch.Tensor) -> torch.Tensor:
    """The last token of positive mass in each row of probs [..., vocab] (-1: none)."""
    ids = torch.arange(probs.shape[-1], device=probs.device)
    return torch.where(probs > 0, ids, -1).amax(dim=-1)


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

    Row r uses only generators[r] (one uniform per call), so a request's draws never depend on
    which other requests share the batch. `check_values`: validate the arguments first (the
    stages pass False).
    """
    if check_values:
        check_shape("probs", probs, (None, None))
        check_generators("generators", generators, probs.shape[0], probs.device)
        if probs.shape[1] == 0:
            raise ValueError("probs must have a non-empty vocab dimension")
        check_finite("probs", probs)
        if bool((probs < 0).any()) or bool((probs.sum(dim=-1) <= 0).any()):
            raise ValueError("probs must be non-negative with a positive sum per row")
    return inverse_cdf(probs, uniform_noise(generators, (), probs.device))
