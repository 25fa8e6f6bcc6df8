"""Tests for avspec.engine.sampling: temperature / top-p warp and seeded per-request sampling."""

import pytest
import torch

from avspec.engine.sampling import sample, warp_probs


def _warp(logits, temperature, top_p):
    return warp_probs(
        torch.tensor(logits, dtype=torch.float32)[None, None],
        torch.tensor([temperature]),
        torch.tensor([top_p]),
    )[0, 0]


def test_temperature_one_full_top_p_is_softmax():
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    got = _warp(logits.tolist(), 1.0, 1.0)
    torch.testing.assert_close(got, torch.softmax(logits, -1))


def test_temperature_scales_logits():
    logits = torch.tensor([1.0, 2.0, 0.5])
    got = _warp(logits.tolist(), 0.5, 1.0)
    torch.testing.assert_close(got, torch.softmax(logits / 0.5, -1))


def test_top_p_keeps_smallest_nucleus_and_renormalises():
    probs = torch.tensor([0.1, 0.5, 0.3, 0.1])
    got = _warp(probs.log().tolist(), 1.0, 0.75)  # 0.5 + 0.3 reaches 0.75
    torch.testing.assert_close(got, torch.tensor([0.0, 0.625, 0.375, 0.0]))
    got = _warp(probs.log().tolist(), 1.0, 0.85)  # needs a third token (tie: lower id kept)
    torch.testing.assert_close(got, torch.tensor([0.1, 0.5, 0.3, 0.0]) / 0.9)


def test_tiny_top_p_keeps_top_token():
    got = _warp([0.0, 3.0, 1.0], 1.0, 1e-6)
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0]))


def test_temperature_zero_is_one_hot_ties_to_lowest_id():
    got = _warp([1.0, 5.0, 5.0, 2.0], 0.0, 0.5)
    torch.testing.assert_close(got, torch.tensor([0.0, 1.0, 0.0, 0.0]))


def test_masked_logits_get_zero_probability():
    got = _warp([0.0, float("-inf"), 0.0], 1.0, 1.0)
    torch.testing.assert_close(got, torch.tensor([0.5, 0.0, 0.5]))


def test_rows_use_their_own_settings():
    logits = torch.tensor([[[0.0, 1.0, 2.0]], [[0.0, 1.0, 2.0]]])
    got = warp_probs(logits, torch.tensor([0.0, 1.0]), torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(got[0, 0], torch.tensor([0.0, 0.0, 1.0]))
    torch.testing.assert_close(got[1, 0], torch.softmax(logits[1, 0], -1))
    assert got.dtype == torch.float32 and got.shape == (2, 1, 3)


@pytest.mark.parametrize(
    ("logits", "temperature", "top_p", "match"),
    [
        (torch.zeros(2, 3), torch.ones(2), torch.ones(2), "logits must have shape"),
        (torch.zeros(2, 1, 3), torch.ones(3), torch.ones(2), "temperature must have shape"),
        (torch.zeros(2, 1, 3), torch.ones(2), torch.ones(1), "top_p must have shape"),
        (torch.zeros(2, 1, 0), torch.ones(2), torch.ones(2), "non-empty vocab"),
        (torch.zeros(1, 1, 3), torch.tensor([-0.1]), torch.ones(1), "temperature must be >= 0"),
        (torch.zeros(1, 1, 3), torch.ones(1), torch.tensor([0.0]), r"top_p must lie in \(0, 1\]"),
        (torch.zeros(1, 1, 3), torch.ones(1), torch.tensor([1.5]), r"top_p must lie in \(0, 1\]"),
        (torch.tensor([[[0.0, float("nan")]]]), torch.ones(1), torch.ones(1), "logits contains"),
        (torch.full((1, 1, 2), float("-inf")), torch.ones(1), torch.ones(1), "every token"),
        (torch.zeros(1, 1, 3), torch.tensor([float("nan")]), torch.ones(1), "temperature contains"),
    ],
)
def test_warp_rejects_bad_input(logits, temperature, top_p, match):
    with pytest.raises(ValueError, match=match):
        warp_probs(logits, temperature, top_p)


def test_warp_rejects_mixed_devices():
    with pytest.raises(ValueError, match="share one device"):
        warp_probs(torch.zeros(1, 1, 3), torch.ones(1), torch.ones(1, device="meta"))


def _gens(*seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_sample_is_seeded_and_batch_independent():
    probs = torch.softmax(torch.randn(3, 50, generator=torch.Generator().manual_seed(0)), -1)
    together = sample(probs, _gens(1, 2, 3))
    alone = sample(probs[1:2], _gens(2))
    assert together.dtype == torch.int64 and together.shape == (3,)
    assert together[1] == alone[0]
    assert torch.equal(together, sample(probs, _gens(1, 2, 3)))


def test_sample_matches_distribution():
    """40k seeded draws of a 4-token distribution: each frequency within 0.01 (> 4 sigma)."""
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    gen = torch.Generator().manual_seed(7)
    draws = torch.cat([sample(probs.expand(1000, 4), [gen] * 1000) for _ in range(40)])
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    torch.testing.assert_close(freq, probs, atol=0.01, rtol=0)


def test_sample_never_draws_zero_probability():
    probs = torch.tensor([[0.0, 1.0, 0.0]]).expand(200, 3)
    assert (sample(probs, _gens(*range(200))) == 1).all()


def test_sample_empty_batch():
    assert sample(torch.zeros(0, 4), []).shape == (0,)


@pytest.mark.parametrize(
    ("probs", "gens", "match"),
    [
        (torch.ones(2, 3) / 3, _gens(1), "one generator per request"),
        (torch.ones(1, 3) / 3, ["seed"], "torch.Generator"),
        (torch.ones(3) / 3, _gens(1), "probs must have shape"),
        (torch.tensor([[0.5, -0.5, 1.0]]), _gens(1), "non-negative"),
        (torch.zeros(1, 3), _gens(1), "non-negative"),
        (torch.tensor([[float("nan"), 1.0]]), _gens(1), "probs contains"),
        (torch.zeros(1, 0), _gens(1), "non-empty vocab"),
    ],
)
def test_sample_rejects_bad_input(probs, gens, match):
    with pytest.raises(ValueError, match=match):
        sample(probs, gens)


def test_sample_rejects_generator_on_other_device():
    with pytest.raises(ValueError, match="generator on"):
        sample(torch.ones(1, 3, device="meta"), _gens(1))


def test_inverse_cdf_edges():
    """u = 0 never lands on a leading zero-mass token (a left-sided search would); a point
    rounded past the last running sum takes the last token of positive mass."""
    from avspec.engine.sampling import inverse_cdf

    probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    assert inverse_cdf(probs, torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)).tolist() == [
        1,
        1,
        0,
    ]
    cumulative = torch.cumsum(probs[:1].double(), -1)
    assert torch.searchsorted(cumulative, torch.zeros(1, 1, dtype=torch.float64)).item() == 0


def test_draft_warp_is_the_warp_within_the_top_k():
    """top_k 3 of 6: temperature, top-p inside the three best, renormalised; 0 = warp_probs."""
    from avspec.engine.sampling import draft_warp

    logits = torch.log(torch.tensor([[[0.05, 0.4, 0.12, 0.3, 0.03, 0.1]]]))
    one, full = torch.ones(1), torch.ones(1)
    q = draft_warp(logits, one, full, 3)[0, 0]
    torch.testing.assert_close(q, torch.tensor([0.0, 0.4, 0.12, 0.3, 0.0, 0.0]) / 0.82)
    q = draft_warp(logits, one, torch.tensor([0.6]), 3)[0, 0]  # 0.5 then 0.375 reach 0.6
    torch.testing.assert_close(q, torch.tensor([0.0, 4 / 7, 0.0, 3 / 7, 0.0, 0.0]))
    greedy = draft_warp(logits, torch.zeros(1), full, 3)[0, 0]
    assert greedy.tolist() == [0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    torch.testing.assert_close(draft_warp(logits, one, full, 0), warp_probs(logits, one, full))


def test_warp_of_a_row_is_the_same_alone_and_in_a_batch_on_two_threads():
    """On two threads torch sums a lone row of over 32k values in two halves, a row of a
    batch in one go (another rounding); the warp must not care: 16 flat rows of 40,000
    logits (top-p 1 and 0.95), each warped alone and in the batch, agree bit for bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(5)
        logits = (torch.randn(16, 1, 40_000, generator=gen) * 0.3).bfloat16()
        temperature, top_p = torch.ones(16), torch.tensor([1.0, 0.95]).repeat(8)
        batch = warp_probs(logits, temperature, top_p)
        for r in range(16):
            alone = warp_probs(logits[r : r + 1], temperature[r : r + 1], top_p[r : r + 1])
            assert torch.equal(alone, batch[r : r + 1]), r
    finally:
        torch.set_num_threads(threads)


def test_inverse_cdf_equals_the_minimum_with_the_last_positive_token():
    """The CPU takes the last token of positive mass only for points past the end: the same
    tokens as min(search, last positive) on rows with zero runs, zero tails and all-zero
    rows, for uniforms from 0 to just below 1."""
    from avspec.engine.sampling import inverse_cdf

    gen = torch.Generator().manual_seed(6)
    probs = torch.rand(400, 50, generator=gen) * (torch.rand(400, 50, generator=gen) < 0.3)
    probs[::7, 30:] = 0.0
    probs[::50] = 0.0
    uniforms = torch.rand(400, generator=gen, dtype=torch.float64)
    uniforms[::3] = 1.0 - 2.0**-53
    uniforms[1::3] = 0.0
    cumulative = torch.cumsum(probs.double(), dim=-1)
    search = torch.searchsorted(cumulative, (uniforms * cumulative[:, -1])[:, None], right=True)
    last_positive = torch.where(probs > 0, torch.arange(50), -1).amax(dim=-1)
    want = torch.minimum(search[:, 0], last_positive)
    assert torch.equal(inverse_cdf(probs, uniforms), want)
    assert (search[:, 0] == 50).any()  # points past the end were exercised
