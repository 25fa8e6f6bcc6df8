"""Tests for avspec.av.survival: cumulative survival, candidates, prefix-closed top-k admission."""

import pytest
import torch

from avspec.av.survival import admit, admitted_mask, survival


def test_survival_is_cumprod_with_padding_zeroed():
    conf = torch.tensor([[0.5, 0.5, 0.5], [0.9, float("nan"), 0.2]])
    values, cand = survival(conf, torch.tensor([3, 1]))
    torch.testing.assert_close(values, torch.tensor([[0.5, 0.25, 0.125], [0.9, 0.0, 0.0]]))
    assert cand.tolist() == [[True, True, True], [True, False, False]]


def test_admit_takes_global_top_budget():
    values, cand = survival(torch.tensor([[0.9, 0.9, 0.1], [0.5, 0.5, 0.5]]), torch.tensor([3, 3]))
    # values: [0.9, 0.81, 0.081], [0.5, 0.25, 0.125]
    assert admit(values, cand, 3).tolist() == [2, 1]
    assert admit(values, cand, 0).tolist() == [0, 0]
    assert admit(values, cand, 100).tolist() == [3, 3]
    assert admit(values, cand, torch.tensor(4)).dtype == torch.int32


def _assert_prefix_closed(mask):
    # A prefix mask never turns back on after turning off.
    assert (mask[:, 1:] <= mask[:, :-1]).all(), mask


def test_admission_prefix_closed_with_ties_and_zeros():
    conf = torch.tensor(
        [
            [1.0, 1.0, 0.5, 0.0],  # survival 1, 1, .5, 0: ties inside the row, zeros at the end
            [0.5, 1.0, 1.0, 1.0],  # .5 .5 .5 .5: ties with row 0's position 2
            [0.0, 1.0, 1.0, 1.0],  # all zero
        ]
    )
    values, cand = survival(conf, torch.tensor([4, 4, 3]))
    expected = {
        0: [0, 0, 0], 1: [1, 0, 0], 2: [2, 0, 0], 3: [2, 1, 0], 4: [2, 2, 0], 5: [3, 2, 0],
        6: [3, 3, 0], 7: [3, 4, 0], 8: [3, 4, 1], 9: [3, 4, 2], 10: [3, 4, 3], 11: [4, 4, 3],
        12: [4, 4, 3],
    }  # fmt: skip
    for budget, want in expected.items():
        mask = admitted_mask(values, cand, budget)
        _assert_prefix_closed(mask)
        assert int(mask.sum()) == min(budget, 11)
        assert admit(values, cand, budget).tolist() == want, budget


def test_ties_go_to_earlier_position_then_lower_batch_index():
    values, cand = survival(torch.ones(3, 2), torch.tensor([2, 2, 2]))
    assert admit(values, cand, 2).tolist() == [1, 1, 0]
    assert admit(values, cand, 4).tolist() == [2, 1, 1]


def test_random_admission_always_prefix_and_exact_count():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        conf = torch.rand(5, 4, generator=gen).round(decimals=1)  # many ties and zeros
        ndt = torch.randint(0, 5, (5,), generator=gen)
        values, cand = survival(conf, ndt)
        budget = int(torch.randint(0, 22, (), generator=gen))
        mask = admitted_mask(values, cand, budget)
        _assert_prefix_closed(mask)
        num_verify = admit(values, cand, budget)
        assert int(num_verify.sum()) == min(budget, int(ndt.sum()))
        assert (num_verify <= ndt).all()


def test_leading_dims_are_independent_slices():
    values, cand = survival(torch.full((2, 2, 2), 0.5), torch.full((2, 2), 2))
    got = admit(values, cand, torch.tensor([1, 3]))
    assert got.tolist() == [[1, 0], [2, 1]]


def test_empty_batch():
    values, cand = survival(torch.zeros(0, 3), torch.zeros(0, dtype=torch.int64))
    assert admit(values, cand, 5).shape == (0,)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(3), torch.tensor([1])), "confidences must have shape"),
        ((torch.zeros(2, 3), torch.tensor([1])), "num_draft_tokens must have shape"),
        ((torch.zeros(2, 3), torch.tensor([1, 1], device="meta")), "share one device"),
    ],
)
def test_survival_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        survival(*args)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((torch.zeros(3), torch.ones(3, dtype=torch.bool), 1), "survival must have shape"),
        ((torch.zeros(2, 3), torch.ones(2, 2, dtype=torch.bool), 1), "candidates must have"),
        ((torch.zeros(2, 3), torch.ones(2, 3), 1), "bool tensor"),
        ((torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), -1), "budget must be >= 0"),
        ((torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor(1.0)), "integer"),
        (
            (torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool), torch.tensor(1, device="meta")),
            "share one device",
        ),
    ],
)
def test_admit_rejects_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        admit(*args)
