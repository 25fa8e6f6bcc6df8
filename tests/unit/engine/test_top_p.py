"""avspec.engine.top_p: every CPU path keeps exactly the stable sort's nucleus (ties at the edge
to the lower id), renormalised; broken variants (ties kept the other way, a fast path blind to
ties at the edge) are caught by the same comparisons."""

from __future__ import annotations

import torch

from avspec.engine import top_p as nucleus


def _nucleus_cases(seed: int = 0, trials: int = 200):
    """Probabilities [3, 4, vocab] and top_p [3, 1, 1]: vocabularies around NUCLEUS_TIERS,
    peaked and flat rows, rounded logits (ties at the nucleus edge), masked tails, top_p = 1."""
    gen = torch.Generator().manual_seed(seed)
    for trial in range(trials):
        vocab = (5, 64, 65, 257, 4096, 1024, 1025)[trial % 7]
        logits = torch.randn(3, 4, vocab, generator=gen) * (0.1, 1.0, 3.0, 10.0)[trial % 4]
        if trial % 3 == 0:
            logits = (logits * 2).round() / 2
        if trial % 7 == 0:
            logits[..., vocab // 2 :] = float("-inf")
        top_p = torch.rand(3, generator=gen).clamp_min(0.01)[:, None, None]
        if trial % 6 == 0:
            top_p = torch.ones(3, 1, 1)
        yield torch.softmax(logits, dim=-1), top_p


def test_cpu_nucleus_equals_the_stable_sort():
    """The CPU top-p (topk values, then numpy-sorted values) keeps exactly the tokens the stable
    sort keeps, ties at the edge included, on 200 batches of 12 rows."""
    for probs, top_p in _nucleus_cases():
        whole = top_p >= 1
        assert torch.equal(nucleus.nucleus_by_topk(probs, top_p, whole) | whole,
                           nucleus.nucleus_by_sort(probs, top_p) | whole)  # fmt: skip


def test_cpu_top_p_keeps_the_stable_sorts_nucleus_on_its_fast_path_too():
    """The CPU top-p (`_top_p_cpu`: most rows from the first topk, the rest as above) keeps
    exactly the stable sort's nucleus, renormalised within 1e-6, on 200 batches of 12 rows; the
    cases take both paths (peaked rows, rows with ties at the edge, long nuclei)."""
    fast_rows = slow_rows = 0
    for probs, top_p in _nucleus_cases():
        whole = top_p >= 1
        want = nucleus.renormalised(probs, nucleus.nucleus_by_sort(probs, top_p) | whole)
        got = nucleus._top_p_cpu(probs, top_p, whole)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        fast, slow = _fast_path_rows(probs, top_p, whole)
        fast_rows, slow_rows = fast_rows + fast, slow_rows + slow
    assert fast_rows > 300 and slow_rows > 300


def _fast_path_rows(probs: torch.Tensor, top_p: torch.Tensor, whole: torch.Tensor):
    """How many rows `_top_p_cpu` takes on its fast path, and how many it does not."""
    k = nucleus.NUCLEUS_TIERS[0]
    if probs.shape[-1] <= k:
        return 0, probs[..., 0].numel()
    values = torch.topk(probs, k, dim=-1).values
    count = ((values.cumsum(-1) - values) < top_p).sum(-1)
    t = values.gather(-1, (count - 1)[..., None])[..., 0]
    after = values.gather(-1, count.clamp(max=k - 1)[..., None])[..., 0]
    fast = (count < k) & (after < t) & ~whole[..., 0]
    return int(fast.sum()), int((~fast).sum())


def test_cpu_top_p_comparison_catches_a_fast_path_blind_to_ties_at_the_edge(monkeypatch):
    """BROKEN: a fast path that keeps topk's first n values even when a tie straddles the edge
    (topk does not order equal values by id): the comparison above fails."""

    def blind(probs, top_p, whole):
        vocab = probs.shape[-1]
        rows = probs.reshape(-1, vocab)
        values, index = torch.topk(rows, min(vocab, 64), dim=-1)
        count = (values.cumsum(-1) - values) < top_p.expand(*probs.shape[:-1], 1).reshape(-1, 1)
        kept = values * count
        out = torch.zeros_like(rows).scatter_(-1, index, kept / kept.sum(-1, keepdim=True))
        return out.reshape(probs.shape)

    differs = False
    for probs, top_p in _nucleus_cases():
        if probs.shape[-1] <= 64 or bool((top_p >= 1).any()):
            continue
        want = nucleus.renormalised(probs, nucleus.nucleus_by_sort(probs, top_p))
        short = (want > 0).sum(-1).max() < 64  # every nucleus within the first 64 values
        if short and not torch.equal(blind(probs, top_p, top_p >= 1) > 0, want > 0):
            differs = True
            break
    assert differs


def test_nucleus_comparison_catches_ties_broken_the_other_way():
    """The same comparison fails for a nucleus that keeps the highest ids of a tie."""

    def highest_ids_first(probs, top_p):
        flipped = nucleus.nucleus_by_sort(probs.flip(-1), top_p)
        return flipped.flip(-1)

    differs = any(
        not torch.equal(
            highest_ids_first(probs, top_p) | (top_p >= 1),
            nucleus.nucleus_by_sort(probs, top_p) | (top_p >= 1),
        )  # fmt: skip
        for probs, top_p in _nucleus_cases()
    )
    assert differs
