"""Draft stage: drafts match full recomputation across accept/reject cycles; idle sweep; errors."""

from __future__ import annotations

import pytest
import torch
from helpers.stages import K, make_draft_stage, make_inputs, tiny_model

from avspec.engine.draft_stage import DraftStage
from avspec.runtime.transformer import Transformer

pytestmark = pytest.mark.usefixtures("single_thread")


def reference_probs(model: Transformer, context: list[int], drafts: list[int]) -> torch.Tensor:
    """softmax of full-recompute logits predicting each draft: [len(drafts), vocab]."""
    ids = torch.tensor([context + drafts[:-1]]) if drafts else torch.tensor([context])
    logits = model(ids)[0, len(context) - 1 :]
    return torch.softmax(logits.float(), dim=-1)


def test_drafts_match_full_recomputation_over_accept_reject_cycles() -> None:
    """Three sequences (K, 2 and 0 drafts) for 6 steps with random accept counts and tokens."""
    model = tiny_model(0)
    stage = make_draft_stage(model)
    rng = torch.Generator().manual_seed(1)
    seqs = {
        1: {"committed": [3, 1, 4, 1, 5], "n": K},
        2: {"committed": [9, 2], "n": 2},
        3: {"committed": [7], "n": 0},
    }
    pending = {s: (list(v["committed"]), 0) for s, v in seqs.items()}
    starts = dict.fromkeys(seqs, 0)
    for _ in range(6):
        rows = [
            {
                "seq_id": s,
                "tokens": pending[s][0],
                "start": starts[s],
                "reusable": pending[s][1],
                "n": v["n"],
                "seed": s,
            }  # fmt: skip
            for s, v in seqs.items()
        ]
        out = stage(make_inputs(rows))
        for r, (s, v) in enumerate(seqs.items()):
            n = v["n"]
            drafts = out.draft_tokens[r, :n].tolist()
            want = reference_probs(model, v["committed"], drafts)[:n]
            torch.testing.assert_close(out.draft_probs[r, :n], want, atol=1e-5, rtol=1e-4)
            assert (
                out.draft_probs[r, n:].abs().sum() == 0
                and out.draft_features[r, n:].abs().sum() == 0
            )
            assert stage.cache.length(s) == len(v["committed"]) + max(n - 1, 0)
            accepted = int(torch.randint(0, n + 1, (), generator=rng))
            new = drafts[:accepted] + [int(torch.randint(0, 256, (), generator=rng))]
            starts[s] = len(v["committed"])
            v["committed"] += new
            pending[s] = (new, accepted)


def test_greedy_drafts_and_features() -> None:
    model = tiny_model(2)
    stage = make_draft_stage(model)
    context = [10, 20, 30]
    out = stage(make_inputs([{"seq_id": 5, "tokens": context, "temperature": 0.0}]))
    greedy = list(context)
    for _ in range(K):
        greedy.append(int(model(torch.tensor([greedy]))[0, -1].argmax()))
    assert out.draft_tokens[0].tolist() == greedy[3:]
    assert torch.all(out.draft_probs[0].max(dim=-1).values == 1.0)
    logits = model(torch.tensor([greedy[:-1]]))[0, 2:].float()
    z = logits - logits.max(dim=-1, keepdim=True).values
    qmax = 1 / torch.exp(z).sum(dim=-1)
    torch.testing.assert_close(
        out.draft_features[0],
        torch.log(qmax / (1 - qmax)).float().clamp(-40, 40),
        atol=1e-3,
        rtol=1e-3,
    )
    assert out.draft_tokens.dtype == torch.int32 and out.draft_probs.dtype == torch.float32


def test_draws_do_not_depend_on_the_batch() -> None:
    model = tiny_model(3)
    alone = make_draft_stage(model)(make_inputs([{"seq_id": 1, "tokens": [1, 2, 3], "seed": 42}]))
    rows = [
        {"seq_id": 7, "tokens": [9] * 6, "seed": 3},
        {"seq_id": 1, "tokens": [1, 2, 3], "seed": 42},
    ]
    batched = make_draft_stage(model)(make_inputs(rows))
    assert batched.draft_tokens[1].tolist() == alone.draft_tokens[0].tolist()
    torch.testing.assert_close(batched.draft_probs[1], alone.draft_probs[0])


def test_replayed_first_step_draws_the_same() -> None:
    model = tiny_model(4)
    stage = make_draft_stage(model)
    inputs = make_inputs([{"seq_id": 1, "tokens": [1, 2, 3], "seed": 5}])
    first = stage(inputs).draft_tokens.tolist()
    assert stage(inputs).draft_tokens.tolist() == first


def test_release_frees_cache() -> None:
    stage = make_draft_stage(tiny_model(5, layers=1))
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}, {"seq_id": 2, "tokens": [2]}]))
    assert stage.cache.has(1) and stage.cache.has(2)
    out = stage(make_inputs([], release=[1, 99]))
    assert out.draft_tokens.shape == (0, K)
    assert not stage.cache.has(1) and stage.cache.has(2)


def test_idle_timeout_frees_sequences_not_seen() -> None:
    now = [0.0]
    stage = make_draft_stage(tiny_model(6, layers=1), idle_timeout_s=10.0, clock=lambda: now[0])
    stage(make_inputs([{"seq_id": 1, "tokens": [1]}, {"seq_id": 2, "tokens": [2]}]))
    now[0] = 8.0
    stage(make_inputs([{"seq_id": 2, "tokens": [5], "start": 1, "n": 1}]))
    now[0] = 15.0
    stage(make_inputs([{"seq_id": 2, "tokens": [5], "start": 2, "n": 1}]))
    assert not stage.cache.has(1), "sequence 1 idle for 15 s > 10 s"
    assert stage.cache.has(2), "sequence 2 was seen at 8 s and is in this step"
    with pytest.raises(ValueError, match="sequence 1 continues"):
        stage(make_inputs([{"seq_id": 1, "tokens": [5], "start": 1}]))


@pytest.mark.parametrize(
    ("row", "match"),
    [
        ({"n": K + 1}, "num_draft_tokens"),
        ({"n": -1}, "num_draft_tokens"),
        ({"reusable": 1}, "reusable"),
        ({"start": -1}, "start_positions"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"start": 3}, "continues"),
    ],
)
def test_bad_inputs(row: dict, match: str) -> None:
    stage = make_draft_stage(tiny_model(7, layers=1))
    with pytest.raises(ValueError, match=match):
        stage(make_inputs([{"seq_id": 1, "tokens": [1]} | row]))


def test_constructor_and_timeout_validation() -> None:
    model = tiny_model(8, layers=1)
    cache = model.new_cache(2, 16, "cpu", torch.float64)
    with pytest.raises(ValueError, match="max_draft_tokens"):
        DraftStage(model, cache, 0)
    with pytest.raises(ValueError, match="idle_timeout_s"):
        DraftStage(model, cache, K, idle_timeout_s=0)
