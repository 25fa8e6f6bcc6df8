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

import numpy as np
import torch

from avspec.checks import check_finite, check_same_device, check_shape

# CPU top-p: how many of the largest values `_nucleus_by_topk` reads, tier by tier, before it
# sorts a whole row (the first tier also gives `_top_p_cpu` its fast path)
NUCLEUS_TIERS = (64, 1024)
TIER_MASS = 0.8  # a row's largest values read so far must hold this share of top_p to go on


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
    if logits.device.type == "cpu" and bool(greedy.all()):
        return _one_hot_argmax(logits)  # the softmax and nucleus would go unused
    scale = _scale(temperature)[:, None, None]
    on_cpu_at_one = logits.device.type == "cpu" and bool((scale == 1).all())
    probs = torch.softmax(logits if on_cpu_at_one else logits / scale, dim=-1)  # x / 1 == x
    probs = _top_p_filter(probs, top_p.float()[:, None, None])
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
    check_shape("logits", logits, (None, 1, None))
    batch = logits.shape[0]
    check_shape("temperature", temperature, (batch,))
    check_shape("top_p", top_p, (batch,))
    if check_values:
        _check_warp_values(logits, temperature, top_p)
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


def _check_warp_values(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor
) -> None:
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


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside the nucleus of probs [batch, position, vocab]; renormalise.

    The nucleus is the prefix of the tokens in stable descending order (ties: lower id first)
    whose mass strictly before each token is < top_p: the smallest prefix reaching top_p, the
    top token always. top_p = 1 keeps every token (whatever the rounding of the running sum).
    On CUDA the nucleus is found by one sort; on the CPU by `_top_p_cpu`, which keeps the same
    tokens without sorting the whole vocabulary.
    """
    whole = top_p >= 1.0
    if probs.device.type != "cpu":
        return _renormalised(probs, _nucleus_by_sort(probs, top_p) | whole)
    if bool(whole.all()):
        return probs / _row_sums(probs)  # every token kept
    return _top_p_cpu(probs, top_p, whole)


def _top_p_cpu(probs: torch.Tensor, top_p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`_top_p_filter` on the CPU: the same tokens kept, most rows without a vocabulary-wide mask.

    Every filtered row's `NUCLEUS_TIERS[0]` largest values come from one `topk`. A row whose
    nucleus ends within them, with the next value strictly below the nucleus's last (no tie
    straddles the edge, so the nucleus is exactly the tokens >= that value, whichever ids `topk`
    gave equal values), is written as those values renormalised, scattered into zeros: no pass
    over its vocabulary but the topk and the zeros. The other filtered rows (a longer nucleus,
    a tie at the edge) go on from that topk to `_nucleus_edge`'s later tiers and
    `_nucleus_mask`. A real target's nuclei at top-p 0.95 are mostly a few tokens long (median
    3 on chat contexts, 11% over 64), so the fast path is most rows; rows with top_p = 1 keep
    every token.
    """
    vocab = probs.shape[-1]
    k = NUCLEUS_TIERS[0]
    if vocab <= k:
        return _renormalised(probs, _nucleus_by_topk(probs, top_p, whole))
    rows = probs.reshape(-1, vocab)
    row_top_p = top_p.expand(*probs.shape[:-1], 1).reshape(-1)
    row_whole = whole.expand(*probs.shape[:-1], 1).reshape(-1)
    filtered = (~row_whole).nonzero()[:, 0]
    every = len(filtered) == rows.shape[0]
    part = rows if every else rows[filtered]
    part_top_p = row_top_p[filtered]
    values, index = torch.topk(part, k, dim=-1)  # [n, k], descending
    n_keep, last, above = _tier_edge(values, part_top_p)
    after = values.gather(-1, n_keep.clamp(max=k - 1)[:, None])[:, 0]
    fast = (n_keep < k) & (after < last)
    if every and not bool(fast.any()):  # no row for the fast path: filter in place, no copies
        edge = _nucleus_edge(part, part_top_p, values)
        return _renormalised(part, _nucleus_mask(part, *edge)).reshape(probs.shape)
    out = torch.zeros_like(rows)
    if not every:  # top_p = 1: every token
        kept_rows = row_whole.nonzero()[:, 0]
        out[kept_rows] = rows[kept_rows] / _row_sums(rows[kept_rows])
    sel = fast.nonzero()[:, 0]
    kept = values[sel] * (torch.arange(k) < n_keep[sel, None])  # [fast, k]
    out[filtered[sel, None], index[sel]] = kept.div_(_row_sums(kept))  # n x k writes
    slow = (~fast).nonzero()[:, 0]
    if len(slow):
        rest = part[slow]
        edge = _nucleus_edge(rest, part_top_p[slow], values[slow])
        out[filtered[slow]] = _renormalised(rest, _nucleus_mask(rest, *edge))
    return out.reshape(probs.shape)


def _nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus mask of probs [..., vocab] (top_p broadcast [..., 1]) from a stable sort."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def _nucleus_by_topk(probs: torch.Tensor, top_p: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """`_nucleus_by_sort`'s mask, from the sorted values only (rows where `skip`: every token).

    The nucleus length n depends only on the values in descending order, so it is read from the
    largest values (`topk`, tier by tier: `NUCLEUS_TIERS`), and for the rows whose nucleus may be
    longer than the last tier from all values sorted by numpy (values only: ~3x faster than
    torch's CPU sort, which also sorts indices). The mask (`_nucleus_mask`) is every token above
    the n-th value t plus, of the tokens equal to t, the lowest ids (the order a stable sort
    gives ties). On 64 x 9 x 4096 probabilities this costs 15-60 % of the stable sort, the least
    when the nuclei fit the first k.
    """
    vocab = probs.shape[-1]
    rows = probs.reshape(-1, vocab)
    row_top_p = top_p.expand(*probs.shape[:-1], 1).reshape(-1)
    active = (~skip.expand(*probs.shape[:-1], 1).reshape(-1)).nonzero()[:, 0]
    if len(active) == rows.shape[0]:
        return _nucleus_rows(rows, row_top_p).reshape(probs.shape)
    keep = torch.ones(rows.shape, dtype=torch.bool)
    if len(active):
        keep[active] = _nucleus_rows(rows[active], row_top_p[active])
    return keep.reshape(probs.shape)


def _nucleus_rows(rows: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """`_nucleus_by_topk` on rows [n, vocab], top_p [n] (every row filtered)."""
    return _nucleus_mask(rows, *_nucleus_edge(rows, top_p))


Edge = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # n_keep, last value t, count above t


def _nucleus_edge(
    rows: torch.Tensor, top_p: torch.Tensor, first: torch.Tensor | None = None
) -> Edge:
    """Where each row's nucleus ends: (n_keep [n] int64, its n_keep-th value t [n], how many
    values exceed t [n] int64), read from the largest values tier by tier (`NUCLEUS_TIERS`,
    then all of them sorted). `first` [n, k]: each row's k largest values, already read.

    A row goes to a tier only if its nucleus can end there and likely does: with mass m in its
    s largest values and v the smallest of them, the next k - s values add at most (k - s) v,
    so a row with m + (k - s) v < top_p cannot end within k; and a row with m < 0.8 top_p
    seldom does (measured on SmolLM2's logits: the nuclei of 65-1,024 tokens had m >= 0.76 in
    nine cases of ten, the longer ones a median of 0.6). Such rows go straight to a later tier,
    in the end the sort, instead of paying a topk first. Which tier reads a row changes only
    the time: every tier finds the same edge.
    """
    n, vocab = rows.shape
    n_keep = torch.empty(n, dtype=torch.int64)
    last = torch.empty(n, dtype=rows.dtype)
    above = torch.empty(n, dtype=torch.int64)
    mass = torch.zeros(n, dtype=torch.float64)  # of the largest `seen` values
    low = torch.ones(n, dtype=rows.dtype)  # the smallest of them
    seen = torch.zeros(n, dtype=torch.int64)
    pending = torch.arange(n)  # the rows whose nucleus may be longer than what was read
    tiers = [t for t in NUCLEUS_TIERS if t < vocab] + [vocab]
    if first is not None:
        tiers = [t for t in tiers if t > first.shape[-1]]
        pending = _read_tier(first, top_p, pending, (n_keep, last, above, mass, low, seen))
    for k in tiers:
        if not len(pending):
            break
        if k < vocab:
            room = (k - seen[pending]).to(mass.dtype) * low[pending].to(mass.dtype)
            goal = top_p[pending].to(mass.dtype)
            can_end = (mass[pending] + room >= goal) & (mass[pending] >= TIER_MASS * goal)
            read, waiting = pending[can_end], pending[~can_end]
        else:
            read, waiting = pending, pending[:0]
        if not len(read):
            continue
        part = rows[read]
        if k < vocab:
            values = torch.topk(part, k, dim=-1).values
        else:
            values = torch.from_numpy(np.sort(part.numpy(), axis=-1)[:, ::-1].copy())
        still = _read_tier(values, top_p[read], read, (n_keep, last, above, mass, low, seen))
        pending = torch.cat([waiting, still])
    return n_keep, last, above


def _read_tier(
    values: torch.Tensor, top_p: torch.Tensor, read: torch.Tensor, state: tuple
) -> torch.Tensor:
    """Record the edge within the largest values [len(read), k] of the rows `read` into
    `state` (n_keep, last, above, mass, low, seen); return the rows whose nucleus may go on."""
    n_keep, last, above, mass, low, seen = state
    k = values.shape[-1]
    n_keep[read], last[read], above[read] = _tier_edge(values, top_p)
    more = n_keep[read] == k
    still = read[more]
    mass[still] = values[more].double().sum(-1)
    low[still] = values[more, -1]
    seen[still] = k
    return still


def _tier_edge(values: torch.Tensor, top_p: torch.Tensor) -> Edge:
    """The edge within the largest values [n, k] (descending) of each row, top_p [n]."""
    mass_before = torch.cumsum(values, dim=-1) - values
    count = _count(mass_before < top_p[:, None])
    t = values.gather(-1, (count - 1)[:, None])  # [n, 1]
    # descending: every value above t precedes it, so lies among these k
    return count, t[:, 0], _count(values > t)


def _nucleus_mask(
    rows: torch.Tensor, n_keep: torch.Tensor, last: torch.Tensor, above: torch.Tensor
) -> torch.Tensor:
    """The nucleus [n, vocab] bool from its edge: every token above t and, of the tokens equal
    to t, the lowest n_keep - above ids (the order a stable sort gives ties). When every row
    keeps all its ties (the usual case for float32 logits) this is `rows >= t`."""
    ties = rows == last[:, None]
    if not bool((_count(ties) > n_keep - above).any()):
        return rows >= last[:, None]
    tie_rows, tie_ids = ties.nonzero(as_tuple=True)  # by row, then by id
    tie_counts = torch.bincount(tie_rows, minlength=rows.shape[0])
    tie_start = torch.cumsum(tie_counts, dim=0) - tie_counts
    cutoff = tie_ids[tie_start + n_keep - above - 1]  # n_keep - above >= 1: t itself is kept
    ids = torch.arange(rows.shape[-1])
    return (rows > last[:, None]) | (ties & (ids <= cutoff[:, None]))


def _count(mask: torch.Tensor) -> torch.Tensor:
    """The True entries per row of mask [n, width] -> [n] int64 (summed in int32: on the CPU
    twice as fast as in int64)."""
    return mask.sum(dim=-1, dtype=torch.int32).long()


def _renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept.div_(_row_sums(kept))  # in place: one fresh [..., vocab] buffer, not two


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True), each row rounded the same whatever the number of rows.

    With several threads torch splits a tensor's only sum between them (its own rounding), so
    a lone row is summed as one of two (itself twice); rows of any batch are summed alike.
    """
    if x.numel() != x.shape[-1]:
        return x.sum(dim=-1, keepdim=True)
    pair = x.reshape(1, -1).expand(2, -1)
    return pair.sum(dim=-1, keepdim=True)[:1].reshape(*x.shape[:-1], 1)


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
    which other requests share the batch.
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
    return inverse_cdf(probs, uniform_noise(generators, (), probs.device))
