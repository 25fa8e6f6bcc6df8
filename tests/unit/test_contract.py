"""The step contract: the host view and its checks, and the budget's base token count."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.stages import K, make_inputs

from avspec.contract import HostStep, base_tokens, read_step_inputs


def test_read_step_inputs_reads_the_bookkeeping_vectors_to_the_host() -> None:
    inputs = make_inputs(
        [{"seq_id": 7, "tokens": [1, 2, 3], "start": 4, "reusable": 2, "n": 3, "seed": 11},
         {"seq_id": 2, "tokens": [5], "n": 0}],
        prev=[1, -2], release=[9],
    )  # fmt: skip
    assert read_step_inputs(inputs, K) == HostStep(
        seq_ids=[7, 2],
        input_lengths=[3, 1],
        start_positions=[4, 0],
        reusable=[2, 0],
        num_draft_tokens=[3, 0],
        random_seed=[11, 0],
        release_seq_ids=[9],
        adaptive=inputs.adaptive.tolist(),
        adaptive_drafting=[False, False],  # not sent: fixed drafting
    )


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda i: setattr(i, "seq_ids", torch.tensor([1, 1])), "distinct"),
        (
            lambda i: setattr(i, "input_lengths", torch.tensor([0, 1], dtype=torch.int32)),
            "input_lengths",
        ),
        (
            lambda i: setattr(i, "input_lengths", torch.tensor([4, 1], dtype=torch.int32)),
            "input_lengths",
        ),
        (lambda i: setattr(i, "top_p", torch.tensor([1.0])), "top_p"),
        (lambda i: setattr(i, "input_ids", torch.zeros(3, 2, dtype=torch.int32)), "input_ids"),
        (lambda i: setattr(i, "release_seq_ids", torch.zeros(1, 1)), "release_seq_ids"),
    ],
)
def test_read_step_inputs_errors(mutate, match) -> None:
    inputs = make_inputs([{"seq_id": 1, "tokens": [1, 2]}, {"seq_id": 2, "tokens": [3]}])
    mutate(inputs)
    with pytest.raises(ValueError, match=match):
        read_step_inputs(inputs, K)


def test_base_tokens_counts_the_pending_inputs_for_torch_and_numpy() -> None:
    lengths, reusable = [3, 1, 5], [2, 0, 4]
    torch_count = base_tokens(
        torch.tensor(lengths, dtype=torch.int32), torch.tensor(reusable, dtype=torch.int32)
    )
    numpy_count = base_tokens(np.asarray(lengths, np.int32), np.asarray(reusable, np.int32))
    assert torch_count == numpy_count == 3 and isinstance(torch_count, int)
    assert base_tokens(torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)) == 0
