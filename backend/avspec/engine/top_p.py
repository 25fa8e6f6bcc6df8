"""Top-p (nucleus) filtering: which tokens a warped distribution keeps, and renormalised.

The nucleus of a row of probabilities is the prefix of its tokens in stable descending order (ties:
the lower id first) whose mass strictly before each token is < top_p: the smallest prefix reaching
top_p, the top token always; top_p = 1 keeps every token. On CUDA it is found by one stable sort
(`nucleus_by_sort`, also the reference the tests hold the rest to). On the CPU a sort of a 49,152-id
row costs milliseconds, and at 64 x 9 positions a step it was most of the target stage's sampling
work, so the CPU path (`top_p_filter` -> `_top_p_cpu`) reads only as many of the largest values as
it needs, tier by tier (`NUCLEUS_TIERS`), and for the usual short nucleus writes its few values
into zeros without a vocabulary-wide mask. Every path keeps exactly the reference's tokens
(tests/unit/engine/test_top_p.py).
"""

from __future__ import annotations

import numpy as np
import torch

# CPU top-p: how many of the largest values `nucleus_by_topk` reads, tier by tier, before it
# sorts a whole row (the first tier also gives `_top_p_cpu` its fast path)
NUCLEUS_TIERS = (64, 1024)
TIER_MASS = 0.8  # a row's largest values read so far must hold this share of top_p to go on


def top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero the tail outside the nucleus of probs [batch, position, vocab]; renormalise.

    The nucleus is the prefix of the tokens in stable descending order (ties: lower id first)
    whose mass strictly before each token is < top_p: the smallest prefix reaching top_p, the
    top token always. top_p = 1 keeps every token (whatever the rounding of the running sum).
    On CUDA the nucleus is found by one sort; on the CPU by `_top_p_cpu`, which keeps the same
    tokens without sorting the whole vocabulary.
    """
    whole = top_p >= 1.0
    if probs.device.type != "cpu":
        return renormalised(probs, nucleus_by_sort(probs, top_p) | whole)
    if bool(whole.all()):
        return probs / row_sums(probs)  # every token kept
    return _top_p_cpu(probs, top_p, whole)


def _top_p_cpu(probs: torch.Tensor, top_p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """`top_p_filter` on the CPU: the same tokens kept, most rows without a vocabulary-wide mask.

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
        return renormalised(probs, nucleus_by_topk(probs, top_p, whole))
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
        return renormalised(part, _nucleus_mask(part, *edge)).reshape(probs.shape)
    out = torch.zeros_like(rows)
    if not every:  # top_p = 1: every token
        kept_rows = row_whole.nonzero()[:, 0]
        out[kept_rows] = rows[kept_rows] / row_sums(rows[kept_rows])
    sel = fast.nonzero()[:, 0]
    kept = values[sel] * (torch.arange(k) < n_keep[sel, None])  # [fast, k]
    out[filtered[sel, None], index[sel]] = kept.div_(row_sums(kept))  # n x k writes
    slow = (~fast).nonzero()[:, 0]
    if len(slow):
        rest = part[slow]
        edge = _nucleus_edge(rest, part_top_p[slow], values[slow])
        out[filtered[slow]] = renormalised(rest, _nucleus_mask(rest, *edge))
    return out.reshape(probs.shape)


def nucleus_by_sort(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The nucleus mask of probs [..., vocab] (top_p broadcast [..., 1]) from a stable sort."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    keep_sorted = mass_before < top_p
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def nucleus_by_topk(probs: torch.Tensor, top_p: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
    """`nucleus_by_sort`'s mask, from the sorted values only (rows where `skip`: every token).

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
    """`nucleus_by_topk` on rows [n, vocab], top_p [n] (every row filtered)."""
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


def renormalised(probs: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    kept = torch.where(keep, probs, 0.0)
    return kept.div_(row_sums(kept))  # in place: one fresh [..., vocab] buffer, not two


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True), each row rounded the same whatever the number of rows.

    With several threads torch splits a tensor's only sum between them (its own rounding), so
    a lone row is summed as one of two (itself twice); rows of any batch are summed alike.
    """
    if x.numel() != x.shape[-1]:
        return x.sum(dim=-1, keepdim=True)
    pair = x.reshape(1, -1).expand(2, -1)
    return pair.sum(dim=-1, keepdim=True)[:1].reshape(*x.shape[:-1], 1)
