"""Per-sequence bookkeeping of the step contract, on plain states without a scheduler.

The scheduler's use of it (batches, releases, counters) is tested in test_scheduler.py.
"""

from __future__ import annotations

import pytest
import torch

from avspec.contract import StepOutputs
from avspec.engine.sequence import (
    Carry,
    GenerationRequest,
    Outcome,
    SequenceState,
    StepReport,
    as_eos_ids,
    build_inputs,
    read_outputs,
)

K = 8
EOS = 256


def state(seq_id: int = 1, prompt_len: int = 3, max_tokens: int = 20, **kw) -> SequenceState:
    request = GenerationRequest([5] * prompt_len, max_tokens, **kw)
    return SequenceState(seq_id, request, print, print, list(request.prompt_ids))


def outputs(rows: list[list[int]], accepted: list[int], verified: list[int]) -> StepOutputs:
    ids = torch.full((len(rows), K + 1), -1, dtype=torch.int32)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row, dtype=torch.int32)
    accepted_t, verified_t = (torch.tensor(v, dtype=torch.int32) for v in (accepted, verified))
    return StepOutputs(ids, accepted_t, verified_t)


@pytest.mark.parametrize(
    ("num_draft_tokens", "max_tokens", "generated", "want"),
    [(8, 20, 0, 8), (8, 20, 15, 4), (8, 20, 19, 0), (4, 1, 0, 0), (0, 20, 0, 0), (8, 9, 0, 8)],
)
def test_drafts_capped_at_max_tokens_minus_generated_minus_one(
    num_draft_tokens: int, max_tokens: int, generated: int, want: int
) -> None:
    seq = state(max_tokens=max_tokens, num_draft_tokens=num_draft_tokens)
    seq.generated = generated
    assert seq.drafts_wanted() == want


def test_commit_keeps_pending_start_and_reusable() -> None:
    seq = state(prompt_len=3, num_draft_tokens=4)
    report = seq.commit(Outcome([10, 11, 12], verified=3, accepted=2), EOS)
    assert report == StepReport([10, 11, 12], 4, 3, 2, False, None)
    assert (seq.pending, seq.start, seq.reusable, seq.generated) == ([10, 11, 12], 3, 2, 3)
    report = seq.commit(Outcome([13], verified=4, accepted=0), EOS)
    assert report == StepReport([13], 4, 4, 0, False, None)
    assert (seq.pending, seq.start, seq.reusable, seq.generated) == ([13], 6, 0, 4)


def test_eos_ends_the_request_and_is_not_emitted() -> None:
    seq = state(prompt_len=4)
    seq.commit(Outcome([20, 21], verified=1, accepted=1), EOS)
    report = seq.commit(Outcome([22, EOS, 23], verified=2, accepted=2), EOS)
    assert report.new_tokens == [22]
    assert report.finished and report.finish_reason == "stop"
    assert seq.generated == 3


def test_ignore_eos_runs_to_max_tokens() -> None:
    seq = state(prompt_len=4, max_tokens=4, ignore_eos=True)
    report = seq.commit(Outcome([EOS, 21, EOS], verified=2, accepted=2), EOS)
    assert report.new_tokens == [EOS, 21, EOS] and not report.finished
    report = seq.commit(Outcome([EOS, 30], verified=1, accepted=1), EOS)
    assert report.new_tokens == [EOS] and report.finish_reason == "length"


def test_any_of_several_eos_ids_ends_the_request() -> None:
    eos_ids = frozenset({EOS, 7})
    seq = state(prompt_len=4)
    assert not seq.commit(Outcome([20, 21], verified=1, accepted=1), eos_ids).finished
    report = seq.commit(Outcome([22, 7, EOS], verified=2, accepted=2), eos_ids)
    assert report.new_tokens == [22] and report.finish_reason == "stop"
    # a list works as well; an id not in the set is an ordinary token
    report = state().commit(Outcome([EOS + 1, EOS], verified=1, accepted=1), [EOS, 9])
    assert report.new_tokens == [EOS + 1] and report.finish_reason == "stop"


def test_eos_ids_normalised() -> None:
    assert as_eos_ids(5) == frozenset({5})
    assert as_eos_ids([5, 6, 5]) == frozenset({5, 6})
    with pytest.raises(ValueError, match="at least one"):
        as_eos_ids([])


def test_eos_first_emits_nothing() -> None:
    report = state().commit(Outcome([EOS], verified=0, accepted=0), EOS)
    assert report == StepReport([], 8, 0, 0, True, "stop")


def test_max_tokens_honoured_exactly() -> None:
    seq = state(max_tokens=5, num_draft_tokens=2)
    assert not seq.commit(Outcome([1, 2, 3], verified=2, accepted=2), EOS).finished
    report = seq.commit(Outcome([4, 5, 6], verified=1, accepted=2), EOS)  # one token too many
    assert report.new_tokens == [4, 5] and report.finish_reason == "length"
    assert seq.generated == 5


def test_length_wins_over_a_later_eos() -> None:
    seq = state(max_tokens=1)
    report = seq.commit(Outcome([7, EOS], verified=1, accepted=1), EOS)
    assert report.new_tokens == [7] and report.finish_reason == "length"


def test_build_inputs_pads_and_fills_every_column() -> None:
    a = state(1, prompt_len=3, temperature=0.5, top_p=0.9, random_seed=7, num_draft_tokens=4)
    b = state(2, prompt_len=1, num_draft_tokens=0, adaptive=False)
    a.commit(Outcome([10, 11], verified=2, accepted=1), EOS)
    prev = torch.tensor([1, -2], dtype=torch.int32)
    plan, timing = torch.tensor([0.5, 2.0, 0.6, 0.1]), torch.tensor([3.0, 1.0, 9.0, 20.0])
    inputs = build_inputs([a, b], [9, 4], Carry(prev, plan, timing))
    assert inputs.seq_ids.tolist() == [1, 2] and inputs.seq_ids.dtype == torch.int64
    assert inputs.input_ids.tolist() == [[10, 11], [5, 0]]
    assert inputs.input_ids.dtype == torch.int32
    assert inputs.input_lengths.tolist() == [2, 1]
    assert inputs.start_positions.tolist() == [3, 0]
    assert inputs.reusable.tolist() == [1, 0]
    assert inputs.num_draft_tokens.tolist() == [4, 0]
    assert inputs.adaptive.tolist() == [True, False]
    assert inputs.temperature.tolist() == [0.5, 1.0]
    assert inputs.top_p.tolist() == pytest.approx([0.9, 1.0])
    assert inputs.random_seed.tolist() == [7, 0]
    assert inputs.prev_num_accepted is prev
    assert inputs.draft_plan is plan and inputs.prev_timing_ms is timing
    assert inputs.adaptive_drafting.tolist() == [True, False]  # only with adaptive
    assert inputs.release_seq_ids.tolist() == [9, 4]
    assert inputs.release_seq_ids.dtype == torch.int64


def test_carry_after_a_step_joins_the_stage_times_and_the_wall_time() -> None:
    outputs = StepOutputs(
        torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32), next_draft_plan=torch.tensor([0.3, 1.0, 0.5, 0.0, 0.0]),
        draft_ms=torch.tensor([2.0, 1.0]), target_ms=torch.tensor([5.0]),
    )  # fmt: skip
    accepted = torch.tensor([0], dtype=torch.int32)
    carry = Carry.after(outputs, accepted, wall_ms=12.0)
    assert carry.prev_timing_ms.tolist() == [2.0, 1.0, 5.0, 12.0]
    assert carry.draft_plan.tolist() == pytest.approx([0.3, 1.0, 0.5, 0.0, 0.0])
    assert carry.prev_num_accepted is accepted
    # A step function that reports no stage times carries no timing.
    bare = StepOutputs(outputs.output_ids, outputs.num_accepted, outputs.num_verify)
    assert Carry.after(bare, accepted, 1.0).prev_timing_ms.numel() == 0


def test_build_inputs_for_a_release_only_step() -> None:
    inputs = build_inputs([], [3], Carry())
    assert inputs.batch_size == 0 and tuple(inputs.input_ids.shape) == (0, 1)
    assert inputs.release_seq_ids.tolist() == [3]


def test_read_outputs_keeps_accepted_plus_one_tokens() -> None:
    a, b = state(1, num_draft_tokens=4), state(2, num_draft_tokens=0)
    got = read_outputs(outputs([[1, 2, 3, 4, 5], [6]], [2, 0], [3, 0]), [a, b], K)
    assert got == {1: Outcome([1, 2, 3], 3, 2), 2: Outcome([6], 0, 0)}


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (StepOutputs(torch.zeros(1, K), torch.zeros(1), torch.zeros(1)), "output_ids"),
        (StepOutputs(torch.zeros(1, K + 1), torch.zeros(2), torch.zeros(1)), "num_accepted"),
        (StepOutputs(torch.zeros(1, K + 1), torch.zeros(1), torch.zeros(0)), "num_verify"),
        (outputs([[1]], [3], [2]), "out of range"),  # accepted > verified
        (outputs([[1]], [0], [5]), "out of range"),  # verified > drafts wanted (4)
        (outputs([[1]], [-1], [0]), "out of range"),
    ],
)
def test_read_outputs_rejects_a_malformed_result(bad: StepOutputs, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        read_outputs(bad, [state(num_draft_tokens=4)], K)
