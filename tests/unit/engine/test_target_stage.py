"""Target stage: verification matches full recomputation across accept/reject cycles; errors.

The pieces with a contract of their own are checked alone too: the packing of the ragged batch
and the target probabilities it yields.
"""

from __future__ import annotations

import pytest
import torch
from helpers.stages import K, make_inputs, make_target_stage, tiny_model

from avspec.contract import read_step_inputs
from avspec.engine.target_stage import TargetStage, pack_verify_batch
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


def greedy(model: Transformer, context: list[int], count: int) -> list[int]:
    tokens = list(context)
    for _ in range(count):
        tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
    return tokens[len(context) :]


def uniform_probs(batch: int) -> torch.Tensor:
    return torch.full((batch, K, 257), 1.0 / 257)


def test_greedy_verification_over_accept_reject_cycles() -> None:
    """Drafts right for the first `m` positions then wrong; 5 steps, 3 sequences, varied verify."""
    model = tiny_model(10)
    stage = make_target_stage(model)
    rng = torch.Generator().manual_seed(0)
    seqs = {1: [3, 1, 4, 1, 5], 2: [2, 7], 3: [8]}
    num_draft = {1: K, 2: 3, 3: 0}
    pending = {s: (list(c), 0) for s, c in seqs.items()}
    starts = dict.fromkeys(seqs, 0)
    for _ in range(5):
        rows, drafts, verify, expect = [], torch.zeros(3, K, dtype=torch.int32), [], []
        for r, (s, committed) in enumerate(seqs.items()):
            n = num_draft[s]
            truth = greedy(model, committed, K + 1)
            right = int(torch.randint(0, n + 1, (), generator=rng))
            row = truth[:K]
            if right < n:
                row[right] = (row[right] + 1) % 256
            drafts[r] = torch.tensor(row)
            v = int(torch.randint(0, n + 1, (), generator=rng))
            verify.append(v)
            expect.append((min(right, v), truth))
            rows.append({"seq_id": s, "tokens": pending[s][0], "start": starts[s],
                         "reusable": pending[s][1], "n": n, "temperature": 0.0})  # fmt: skip
        out = stage(make_inputs(rows), drafts, uniform_probs(3), torch.tensor(verify))
        assert out.output_ids.shape == (3, K + 1) and out.num_verify.tolist() == verify
        for r, (s, committed) in enumerate(seqs.items()):
            accepted, truth = expect[r]
            assert int(out.num_accepted[r]) == accepted
            new = out.output_ids[r, : accepted + 1].tolist()
            assert new == truth[: accepted + 1]
            assert stage.cache.length(s) == len(committed) + accepted
            starts[s] = len(committed)
            committed += new
            pending[s] = (new, accepted)


def test_exact_draft_probs_are_all_accepted_at_temperature_one() -> None:
    """q = the target's own p (full recomputation) => every verified draft is accepted."""
    model = tiny_model(11)
    stage = make_target_stage(model)
    context = [5, 6, 7, 8]
    gen = torch.Generator().manual_seed(3)
    tokens, probs = list(context), []
    for _ in range(K):
        p = torch.softmax(model(torch.tensor([tokens]))[0, -1].float(), dim=-1)
        probs.append(p)
        tokens.append(int(torch.multinomial(p, 1, generator=gen)))
    drafts = torch.tensor([tokens[4:]], dtype=torch.int32)
    inputs = make_inputs([{"seq_id": 1, "tokens": context, "seed": 9}])
    out = stage(inputs, drafts, torch.stack(probs)[None], torch.tensor([K]))
    assert int(out.num_accepted[0]) == K
    assert out.output_ids[0, :K].tolist() == tokens[4:]


def test_pack_verify_batch_rows_and_gather_positions() -> None:
    """Row 0 runs 2 pending inputs and 2 drafts, row 1 its 2 inputs and no draft."""
    input_ids = torch.tensor([[10, 11, 12], [20, 21, 0]], dtype=torch.int32)
    drafts = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]], dtype=torch.int32)
    packed = pack_verify_batch(input_ids, [1, 0], [3, 2], drafts, [2, 0])
    assert packed.tokens.dtype == torch.int64
    assert packed.tokens.tolist() == [11, 12, 1, 2, 20, 21]
    assert packed.lengths == [4, 2]
    # position j reads the token before draft j; past num_verify, the bonus position repeats
    assert packed.gather.tolist() == [[1, 2, 3, 3, 3], [5, 5, 5, 5, 5]]


def test_target_probs_match_full_recomputation_and_repeat_the_bonus() -> None:
    """p at position j is the target's distribution after context + drafts[:j] (j <= verify)."""
    model = tiny_model(16)
    stage = make_target_stage(model)
    context, drafts = [5, 6, 7, 8], [9, 10, 11, 12]
    inputs = make_inputs([{"seq_id": 1, "tokens": context}])
    step = read_step_inputs(inputs, K)
    with torch.inference_mode():
        offsets = stage.slots.prepare(step)
        packed = pack_verify_batch(
            inputs.input_ids, offsets, step.input_lengths, torch.tensor([drafts]), [2]
        )
        probs = stage._target_probs(inputs, step, packed)
    assert probs.shape == (1, K + 1, 257)
    for j in range(3):
        logits = model(torch.tensor([context + drafts[:j]]))[0, -1]
        expected = torch.softmax(logits.float(), dim=-1)
        torch.testing.assert_close(probs[0, j].float(), expected, atol=1e-6, rtol=1e-5)
    for j in range(3, K + 1):
        assert torch.equal(probs[0, j], probs[0, 2])


def test_release_and_empty_batch() -> None:
    stage = make_target_stage(tiny_model(12, layers=1))
    stage(make_inputs([{"seq_id": 4, "tokens": [1, 2]}]), torch.zeros(1, K, dtype=torch.int32),
          uniform_probs(1), torch.tensor([2]))  # fmt: skip
    assert stage.cache.has(4)
    empty = torch.zeros(0, K, dtype=torch.int32)
    out = stage(
        make_inputs([], release=[4]), empty, uniform_probs(0), torch.zeros(0, dtype=torch.int32)
    )
    assert out.output_ids.shape == (0, K + 1) and not stage.cache.has(4)


def test_idle_timeout_frees() -> None:
    now = [0.0]
    stage = make_target_stage(tiny_model(13, layers=1), idle_timeout_s=1.0, clock=lambda: now[0])
    one = (torch.zeros(1, K, dtype=torch.int32), uniform_probs(1), torch.tensor([0]))
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}]), *one)
    now[0] = 2.0
    stage(make_inputs([{"seq_id": 2, "tokens": [1]}]), *one)
    assert not stage.cache.has(1) and stage.cache.has(2)


@pytest.mark.parametrize(
    ("verify", "drafts_shape", "probs_shape", "match"),
    [
        ([K], (1, K), (1, K, 257), "num_verify"),
        ([-1], (1, K), (1, K, 257), "num_verify"),
        ([0, 0], (1, K), (1, K, 257), "num_verify"),
        ([0], (1, K + 1), (1, K, 257), "draft_tokens"),
        ([0], (1, K), (1, K, 10), "draft_probs"),
    ],
)
def test_bad_verify_inputs(verify, drafts_shape, probs_shape, match) -> None:
    stage = make_target_stage(tiny_model(14, layers=1))
    inputs = make_inputs([{"seq_id": 1, "tokens": [1], "n": 2}])
    with pytest.raises(ValueError, match=match):
        stage(inputs, torch.zeros(drafts_shape, dtype=torch.int32), torch.zeros(probs_shape),
              torch.tensor(verify))  # fmt: skip
    assert not stage.cache.has(1), "validation fails before any cache change"


def test_constructor_validation() -> None:
    model = tiny_model(15, layers=1)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        TargetStage(model, model.new_cache(1, 8, "cpu", torch.float64), 0)
