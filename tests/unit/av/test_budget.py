"""Tests for avspec.av.budget: argmax of expected tokens per ms on hand-computed cases."""

import pytest
import torch

from avspec.av.budget import choose_budget
from avspec.av.cost_table import CostTable

FREE_DRAFT = CostTable([1], [0.0], name="draft")
# Spec section 4 staircase: 1 ms with no drafts, 2 ms with one or two (T = 1 base token).
STAIRCASE = CostTable([1, 2, 3], [1.0, 2.0, 2.0], name="verify")


@pytest.mark.parametrize(
    ("s2", "want"),
    [
        (0.3, 2),  # (1.8 + 0.3) / 2 = 1.05 > 1 > 0.9
        (0.1, 0),  # (1.8 + 0.1) / 2 = 0.95 < 1
    ],
)
def test_staircase_example_of_the_spec(s2, want):
    budget = choose_budget(torch.tensor([0.8, s2]), 1, 1, FREE_DRAFT, STAIRCASE)
    assert budget.dtype == torch.int64 and budget.shape == ()
    assert int(budget) == want


def test_exact_tie_goes_to_smallest_budget():
    # (1 + 0.75 + 0.25) / 2 = 1.0 = ratio at b = 0 (exact in binary floating point)
    assert int(choose_budget(torch.tensor([0.75, 0.25]), 1, 1, FREE_DRAFT, STAIRCASE)) == 0


def test_linear_cost_hand_computed():
    # cost[b] = 1 (draft) + 1 + (2 + b) (verify) = 4 + b; expected = 2, 2.9, 3.4, 3.5
    # ratios 0.5, 0.58, 0.567, 0.5 -> b = 1
    draft = CostTable([0, 10], [1.0, 1.0])
    verify = CostTable.linear(fixed_ms=1.0, per_unit_ms=1.0, max_size=4)
    scores = torch.tensor([0.1, 0.9, 0.5])  # order does not matter
    assert int(choose_budget(scores, 2, 2, draft, verify)) == 1
    assert int(choose_budget(scores.flip(0), 2, torch.tensor(2), draft, verify)) == 1


def test_free_verification_takes_every_positive_score():
    verify = CostTable([0], [1.0])
    assert int(choose_budget(torch.tensor([0.5, 0.01, 0.2]), 1, 1, FREE_DRAFT, verify)) == 3


def test_zero_padding_never_changes_the_budget():
    verify = CostTable.linear(fixed_ms=2.0, per_unit_ms=0.3, max_size=16)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        scores = torch.rand(6, generator=gen)
        padded = torch.cat([scores, torch.zeros(5)])
        plain = choose_budget(scores, 3, 3, FREE_DRAFT, verify)
        assert int(choose_budget(padded, 3, 3, FREE_DRAFT, verify)) == int(plain)
        flat = choose_budget(padded, 3, 3, FREE_DRAFT, STAIRCASE)
        assert int(flat) == int(choose_budget(scores, 3, 3, FREE_DRAFT, STAIRCASE))


def test_empty_scores_give_zero():
    assert int(choose_budget(torch.zeros(0), 4, 4, FREE_DRAFT, STAIRCASE)) == 0


def test_zero_cost_takes_every_positive_score():
    zero = CostTable([0], [0.0])
    assert int(choose_budget(torch.tensor([0.5, 0.0]), 1, 1, zero, zero)) == 1


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scores": torch.zeros(2, 2)}, "scores must have shape"),
        ({"num_requests": -1}, "num_requests must be >= 0"),
        ({"base_tokens": -3}, "base_tokens must be >= 0"),
    ],
)
def test_rejects_bad_input(kwargs, match):
    args = {
        "scores": torch.zeros(2),
        "num_requests": 1,
        "base_tokens": 1,
        "draft_cost": FREE_DRAFT,
        "verify_cost": STAIRCASE,
    } | kwargs
    with pytest.raises(ValueError, match=match):
        choose_budget(**args)
