"""`avspec.engine.head_stage`: the draft stage over a draft head, fed by the target's features.

- `merged` and `HeadRow`: values of committed positions merge by position (replays overwrite,
  used positions drop, a gap drops the old values); entries are made only where a feature and
  the token after it are both known;
- greedy generation with a head equals target-only greedy, and the head drafts from its
  second step on (its first has no features yet);
- the head drafts what the dense head computes over the target's features: draft 1 of every
  step's row equals the dense head's distribution at the last committed position but one (an
  entry shifted by one position fails), and the model card's `HeadDrafter` gives drafts 1 and 2
  as the stage does;
- a row whose features were lost (a failed step) drafts nothing and stays exact.

Losslessness of the sampled path is tested in test_stage_lossless.py with the same head.
"""

from __future__ import annotations

import pytest
import torch
from helpers.generation import generate
from helpers.stages import K, tiny_model

from avspec.av.step_cost import StepCost
from avspec.engine.head_stage import HeadRow, merged
from avspec.engine.sampling import warp_probs
from avspec.engine.scheduler import Scheduler
from avspec.engine.sequence import GenerationRequest
from avspec.engine.step import SpeculativeStep, StepCapacity
from avspec.runtime.head import DraftHead, new_head
from avspec.runtime.transformer import Transformer
from avspec.tools.train.head.drafter import HeadDrafter

pytestmark = pytest.mark.usefixtures("single_thread")

EOS = 256
PROMPTS = [[72, 101, 108], [1] * 9, [200, 3, 17, 99, 5, 6], [42]]


def head_pair() -> tuple[Transformer, DraftHead]:
    """A one-block target and a head started from it: the head's entry t reads token t + 1
    through the target's own block, so it nearly is the target (high acceptance)."""
    target = tiny_model(20, layers=1, width=32)
    return target, new_head(target.float(), init_layer=0).double().eval()


def build(target: Transformer, head: DraftHead, on_step=None) -> SpeculativeStep:
    step = SpeculativeStep.from_models(
        target.double(), head, StepCapacity(K, 8, 96),
        cost=StepCost.linear(0.1, 0.01, 1.0, 0.2, max_rows=64, max_tokens=512),
    )  # fmt: skip
    step.on_step = on_step
    return step


def greedy_reference(model: Transformer, prompt: list[int], max_tokens: int) -> list[int]:
    tokens: list[int] = []
    for _ in range(max_tokens):
        token = int(model(torch.tensor([prompt + tokens]))[0, -1].argmax())
        if token == EOS:
            break
        tokens.append(token)
    return tokens


def test_merged_values_by_position():
    join = lambda parts: sum(parts, [])  # noqa: E731
    assert merged(3, [3, 4], 5, [5, 6], join) == (3, [3, 4, 5, 6])  # appended
    assert merged(3, [3, 4, 5], 4, [9], join) == (3, [3, 9, 5])  # a replay overwrites
    assert merged(3, [3, 4], 1, [1, 2, 3, 4, 5], join) == (3, [3, 4, 5])  # used ones dropped
    assert merged(3, [3, 4], 7, [7], join) == (7, [7])  # a gap: the old ones go


def test_a_row_makes_entries_where_feature_and_next_token_are_known():
    row = HeadRow()
    row.add_tokens(0, [10, 11, 12])  # the prompt; no features yet
    assert row.ready() == 0
    row.add_features(0, torch.arange(3.0)[:, None])  # the target ran the prompt
    row.add_tokens(3, [13])  # its first token
    assert row.ready() == 3
    features, tokens = row.take(3)
    assert features[:, 0].tolist() == [0.0, 1.0, 2.0] and tokens == [11, 12, 13]
    assert row.entries == 3 and row.ready() == 0
    row.add_features(3, torch.tensor([[3.0], [4.0]]))  # the token 13 and one accepted draft
    row.add_tokens(4, [14, 15])  # that draft and the bonus
    assert row.ready() == 2 and row.take(2)[1] == [14, 15]


def test_greedy_with_a_head_equals_target_only():
    target, head = head_pair()
    references = [greedy_reference(target.double(), p, 12) for p in PROMPTS]
    drafted: list[int] = []
    step = build(target, head, lambda i, d, v, o: drafted.append(int(d.num_drafted.sum())))
    scheduler = Scheduler(step, EOS, 8, 96, K)
    requests = [GenerationRequest(p, 12, temperature=0.0, num_draft_tokens=K) for p in PROMPTS]
    assert generate(scheduler, requests) == references
    assert drafted[0] == 0 and sum(drafted) > 0, "nothing to draft from before the prefill"
    c = scheduler.counters
    assert c.accepted > 0.5 * c.verified > 0
    assert step.draft.cache.num_live == 0 and step.target.cache.num_live == 0


@torch.no_grad()
def test_draft_one_is_the_dense_heads_distribution():
    target, head = head_pair()
    target = target.double()
    seen: list[tuple] = []
    step = build(target, head, lambda i, d, v, o: seen.append((i, d)))
    prompt = [5, 17, 200, 3, 9]
    request = GenerationRequest(list(prompt), 10, 0.7, 0.9, random_seed=3, num_draft_tokens=K,
                                adaptive=False)  # fmt: skip
    tokens: list[int] = []
    scheduler = Scheduler(step, EOS, 4, 96, K)
    scheduler.submit(request, lambda r: tokens.extend(r.new_tokens), pytest.fail)
    scheduler.run_until_idle()
    checked = 0
    for inputs, drafted in seen[1:]:
        if inputs.batch_size == 0:  # the release-only call at the end
            continue
        length = int(inputs.start_positions[0] + inputs.input_lengths[0])
        committed = (prompt + tokens)[:length]
        if int(drafted.num_drafted[0]) == 0:
            continue
        ids = torch.tensor([committed])
        features = target.final_norm(_last_hidden(target, ids[:, :-1]))
        guess = head(features, ids[:, 1:])[:, -1]  # the entry at the last position but one
        logits = head.logits(guess)[:, None]
        q = warp_probs(logits, torch.tensor([0.7]), torch.tensor([0.9]))[0, 0]
        assert torch.allclose(drafted.draft_probs[0, 0].double(), q.double(), atol=1e-5)
        # the model card's drafter (HeadDrafter) drafts as the stage does, at depth 2 too
        card = HeadDrafter(head, target, None)
        for depth in range(min(2, drafted.draft_probs.shape[1])):
            chain = ids if depth == 0 else torch.cat([ids, drafted.draft_tokens[:, :1].long()], 1)
            q = warp_probs(card(chain), torch.tensor([0.7]), torch.tensor([0.9]))[0, 0]
            assert torch.allclose(drafted.draft_probs[0, depth].double(), q.double(), atol=1e-5)
            checked += depth
        checked += 1
    assert checked >= 3


def _last_hidden(model: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The last block's output at every position of ids [1, seq] (dense)."""
    x = model.embed(ids)
    for block in model.blocks:
        x = block(x, model.rotary)
    return x


def test_lost_features_stop_drafting_and_keep_the_output_exact():
    target, head = head_pair()
    reference = greedy_reference(target.double(), PROMPTS[2], 12)
    drafted: list[int] = []
    step = build(target, head, lambda i, d, v, o: drafted.append(int(d.num_drafted.sum())))

    def losing(inputs):  # the features of the third step never arrive
        if len(drafted) == 3:
            inputs.prev_target_features = torch.zeros(0, 0)
            inputs.prev_feature_counts = torch.zeros(0, dtype=torch.int32)
            inputs.prev_feature_starts = torch.zeros(0, dtype=torch.int32)
        return step(inputs)

    losing.max_draft_tokens = K  # type: ignore[attr-defined]
    request = GenerationRequest(PROMPTS[2], 12, temperature=0.0, num_draft_tokens=K)
    assert generate(losing, [request], eos_ids=EOS) == [reference]
    assert drafted[1] > 0 and drafted[2] > 0 and sum(drafted[3:]) == 0
