"""Tests for avspec.av.features.logit_qmax."""

from __future__ import annotations

import math

import pytest
import torch

from avspec.av.features import logit_qmax


def _naive(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    q = torch.softmax(logits.double() / temperature.double().view(-1, 1, 1), dim=-1)
    q_max = q.max(dim=-1).values
    return torch.log(q_max / (1 - q_max))


def test_matches_naive_on_moderate_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 4, 50, generator=gen) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.7, 1.3])
    got = logit_qmax(logits, temperature)
    assert got.shape == (5, 4) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), _naive(logits, temperature), atol=1e-4, rtol=1e-4)


def test_scalar_temperature_and_zero_means_one() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 20, generator=gen)
    ones = logit_qmax(logits, 1.0)
    torch.testing.assert_close(logit_qmax(logits, 0.0), ones)
    torch.testing.assert_close(logit_qmax(logits, torch.zeros(3)), ones)
    torch.testing.assert_close(logit_qmax(logits, torch.tensor(0.0)), ones)
    mixed = logit_qmax(logits, torch.tensor([0.0, 2.0, 0.0]))
    torch.testing.assert_close(mixed[[0, 2]], ones[[0, 2]])
    torch.testing.assert_close(mixed[1], logit_qmax(logits[1:2], 2.0)[0])


def test_extreme_logits_finite_and_clamped() -> None:
    logits = torch.zeros(1, 4, 10)
    logits[0, 0, 3] = 1e4  # one-hot: +clamp
    logits[0, 1] = torch.linspace(-1e30, 1e30, 10)
    logits[0, 2] = float("-inf")
    logits[0, 2, 5] = 0.0  # single allowed token, the rest masked
    logits[0, 3] = -1e6  # uniform over 10: q_max = 0.1
    got = logit_qmax(logits, 1.0)
    assert torch.isfinite(got).all()
    assert got[0, 0] == 40.0 and got[0, 1] == 40.0 and got[0, 2] == 40.0
    assert got[0, 3].item() == pytest.approx(math.log(0.1 / 0.9), abs=1e-5)
    assert logit_qmax(logits, 1.0, clamp=5.0)[0, 0] == 5.0
    # many tokens nearly uniform: very negative but within the clamp
    wide = torch.zeros(1, 1, 100_000)
    assert logit_qmax(wide, 1.0, clamp=5.0)[0, 0] == -5.0


def test_all_masked_row_counts_as_one_hot() -> None:
    logits = torch.full((1, 1, 4), float("-inf"))
    assert logit_qmax(logits, 1.0)[0, 0] == 40.0


def test_ties_count_as_non_max() -> None:
    two_way = torch.tensor([[[2.0, 2.0, float("-inf")]]])
    assert logit_qmax(two_way, 1.0)[0, 0].item() == pytest.approx(0.0, abs=1e-6)  # q_max = 1/2
    three_way = torch.tensor([[[1.0, 1.0, 1.0]]])
    expected = math.log((1 / 3) / (2 / 3))
    assert logit_qmax(three_way, 1.0)[0, 0].item() == pytest.approx(expected, abs=1e-6)


def test_half_precision_input() -> None:
    logits = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(2))
    got = logit_qmax(logits.half(), 1.0)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, logit_qmax(logits.half().float(), 1.0))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_and_pos_inf_rejected(bad: float) -> None:
    logits = torch.zeros(2, 2, 5)
    logits[1, 0, 2] = bad
    with pytest.raises(ValueError, match="logits contains NaN or \\+inf"):
        logit_qmax(logits, 1.0)
    logit_qmax(logits, 1.0, check_values=False)  # allowed when the caller opts out


def test_nan_temperature_rejected() -> None:
    with pytest.raises(ValueError, match="temperature"):
        logit_qmax(torch.zeros(2, 1, 3), torch.tensor([1.0, float("nan")]))


@pytest.mark.parametrize(
    ("logits", "temperature", "match"),
    [
        (torch.zeros(2, 5), 1.0, "logits must have shape"),
        (torch.zeros(2, 1, 0), 1.0, "non-empty vocab"),
        (torch.zeros(2, 1, 3, dtype=torch.long), 1.0, "floating point"),
        (torch.zeros(2, 1, 3), torch.ones(3), "temperature must have shape"),
        (torch.zeros(2, 1, 3), torch.ones(2, device="meta"), "temperature on meta"),
    ],
)
def test_bad_shapes_and_devices(logits: torch.Tensor, temperature: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        logit_qmax(logits, temperature)  # type: ignore[arg-type]
