"""TensorRT-LLM requests built from the verifier's decision, and answers read back.

DOCUMENTED lists the tensorrtllm backend's `tensorrt_llm` model inputs this project sends, with
the data type and dims of the backend's own config.pbtxt template (read from the backend
repository's all_models/inflight_batcher_llm/tensorrt_llm/config.pbtxt; max_batch_size > 0, so a
request adds a leading batch dim of 1).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from avspec.trtllm.request import (
    LOG_ZERO,
    TRTLLM_INPUTS,
    TRTLLM_OUTPUTS,
    ContextLedger,
    RowSampling,
    build_requests,
    draft_log_probs,
    gather_outputs,
    parse_response,
    step_seed,
)

DOCUMENTED = {
    "input_ids": (np.int32, (-1,)),
    "input_lengths": (np.int32, (1,)),
    "request_output_len": (np.int32, (1,)),
    "draft_input_ids": (np.int32, (-1,)),
    "draft_logits": (np.float32, (-1, -1)),
    "temperature": (np.float32, (1,)),
    "runtime_top_k": (np.int32, (1,)),
    "runtime_top_p": (np.float32, (1,)),
    "random_seed": (np.uint64, (1,)),
    "streaming": (np.bool_, (1,)),
}
DOCUMENTED_OUTPUTS = {"output_ids": (np.int32, (-1, -1)), "sequence_length": (np.int32, (-1,))}
K, VOCAB = 4, 6


def matches(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """shape (with the leading batch dim 1) against config dims (-1 = any)."""
    return (
        len(shape) == len(dims) + 1
        and shape[0] == 1
        and all(d == -1 or s == d for s, d in zip(shape[1:], dims, strict=True))
    )


def step(num_verify, temperature=(0.0, 1.0, 0.7), vocab_size=VOCAB, use_logits=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    batch = len(num_verify)
    probs = torch.rand(batch, K, VOCAB, generator=gen)
    probs[:, :, 0] = 0.0  # a zero probability must come back as an exact zero
    probs = probs / probs.sum(-1, keepdim=True)
    drafts = torch.randint(1, VOCAB, (batch, K), generator=gen, dtype=torch.int32)
    contexts = [[5, 6, 7][: i + 1] for i in range(batch)]
    requests = build_requests(
        torch.arange(10, 10 + batch),
        contexts,
        drafts,
        probs,
        torch.tensor(num_verify, dtype=torch.int32),
        RowSampling(
            torch.tensor(temperature[:batch], dtype=torch.float32),
            torch.full((batch,), 0.9),
            torch.arange(batch, dtype=torch.int64) + 100,
        ),
        vocab_size,
        use_logits,
    )
    return requests, drafts, probs, contexts


def test_spec_tables_follow_the_backend_config() -> None:
    assert {n: (s.dtype, s.dims) for n, s in TRTLLM_INPUTS.items()} == DOCUMENTED
    assert {n: (s.dtype, s.dims) for n, s in TRTLLM_OUTPUTS.items()} == DOCUMENTED_OUTPUTS


def test_every_request_tensor_has_the_documented_name_dtype_and_shape() -> None:
    requests, *_ = step([2, 0, 4])
    for request in requests:
        tensors = dict(request.host)
        if request.draft_logits is not None:
            tensors["draft_logits"] = request.draft_logits.numpy()
        for name, array in tensors.items():
            dtype, dims = DOCUMENTED[name]
            assert array.dtype == dtype, name
            assert matches(array.shape, dims), (name, array.shape)
        required = {n for n, s in TRTLLM_INPUTS.items() if not s.optional}
        assert required <= set(tensors)


def test_greedy_row_sends_its_admitted_drafts_without_logits() -> None:
    requests, drafts, _, contexts = step([2, 0, 4])
    greedy = requests[0]
    assert greedy.seq_id == 10
    assert greedy.host["input_ids"].tolist() == [contexts[0]]
    assert greedy.host["input_lengths"].tolist() == [[1]]
    assert greedy.host["draft_input_ids"].tolist() == [drafts[0, :2].tolist()]
    assert greedy.drafts == drafts[0, :2].tolist()
    assert greedy.host["request_output_len"].tolist() == [[3]]
    assert greedy.host["runtime_top_k"].tolist() == [[1]]
    assert greedy.host["temperature"].tolist() == [[1.0]]
    assert greedy.draft_logits is None
    assert greedy.host["streaming"].tolist() == [[False]]


def test_row_with_nothing_admitted_asks_for_one_token_and_no_drafts() -> None:
    requests, *_ = step([2, 0, 4])
    empty = requests[1]
    assert "draft_input_ids" not in empty.host and empty.draft_logits is None
    assert empty.drafts == [] and empty.host["request_output_len"].tolist() == [[1]]
    assert empty.host["runtime_top_k"].tolist() == [[0]]


def test_sampled_row_sends_log_q_that_softmaxes_back_to_q() -> None:
    requests, drafts, probs, _ = step([2, 0, 4], vocab_size=VOCAB + 3)
    sampled = requests[2]
    assert sampled.host["temperature"].tolist() == [[pytest.approx(0.7)]]
    assert sampled.host["runtime_top_p"].tolist() == [[pytest.approx(0.9)]]
    logits = sampled.draft_logits
    assert logits.shape == (1, 4, VOCAB + 3) and logits.dtype == torch.float32
    back = torch.softmax(logits[0], dim=-1)
    torch.testing.assert_close(back[:, :VOCAB], probs[2], rtol=1e-5, atol=1e-7)
    assert (back[:, 0] == 0).all() and (back[:, VOCAB:] == 0).all()
    assert sampled.drafts == drafts[2].tolist()


def test_use_draft_logits_off_sends_token_matching_requests() -> None:
    requests, *_ = step([2, 0, 4], use_logits=False)
    assert all(r.draft_logits is None for r in requests)
    assert "draft_input_ids" in requests[2].host


def test_seeds_change_per_step_and_repeat_for_a_replayed_step() -> None:
    assert step_seed(7, 10) == step_seed(7, 10)
    seeds = {step_seed(s, p) for s in range(4) for p in range(50)}
    assert len(seeds) == 200 and all(0 <= s < 2**64 for s in seeds)
    requests, *_ = step([1, 1, 1])
    assert requests[0].host["random_seed"].tolist() == [[step_seed(100, 1)]]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_verify": [5, 0, 0]}, "num_verify must lie in 0..4"),
        ({"num_verify": [-1, 0, 0]}, "num_verify must lie"),
        ({"vocab_size": VOCAB - 1}, "larger than the engine"),
    ],
)
def test_build_requests_rejects_bad_decisions(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        step(change.get("num_verify", [1, 1, 1]), vocab_size=change.get("vocab_size", VOCAB))


def test_build_requests_rejects_bad_shapes_and_empty_context() -> None:
    drafts = torch.zeros(2, K, dtype=torch.int32)
    probs = torch.full((2, K, VOCAB), 1 / VOCAB)
    common = dict(
        num_verify=torch.zeros(2, dtype=torch.int32),
        sampling=RowSampling(torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.int64)),
        vocab_size=VOCAB,
    )  # fmt: skip
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        build_requests(torch.arange(2), [[1], [2]], drafts, probs[:, :2], **common)
    with pytest.raises(ValueError, match="at least one token"):
        build_requests(torch.arange(2), [[1], []], drafts, probs, **common)
    with pytest.raises(ValueError, match="seq_ids must have shape"):
        build_requests(torch.arange(3), [[1], [2]], drafts, probs, **common)


def test_draft_log_probs_pads_and_clamps() -> None:
    q = torch.tensor([[[0.5, 0.5, 0.0]]])
    logs = draft_log_probs(q, 5)
    assert logs.shape == (1, 1, 5)
    assert logs[0, 0, 2:].tolist() == [LOG_ZERO] * 3
    with pytest.raises(ValueError, match="draft_probs must have shape"):
        draft_log_probs(q[0], 5)


def test_ledger_appends_cuts_and_releases() -> None:
    ledger = ContextLedger(max_sequences=2, max_length=8)
    first = ledger.update(
        torch.tensor([1, 2]), torch.tensor([[5, 6, 7], [8, 0, 0]]), torch.tensor([3, 1]),
        torch.tensor([0, 0]),
    )  # fmt: skip
    assert first == [[5, 6, 7], [8]] and ledger.num_live == 2
    # seq 1 committed 2 more tokens after position 3; seq 2 rewrites from position 1.
    second = ledger.update(
        torch.tensor([1, 2]), torch.tensor([[9, 4], [3, 0]]), torch.tensor([2, 1]),
        torch.tensor([3, 1]),
    )  # fmt: skip
    assert second == [[5, 6, 7, 9, 4], [8, 3]]
    third = ledger.update(torch.tensor([1]), torch.tensor([[2]]), torch.tensor([1]),
                          torch.tensor([2]))  # fmt: skip
    assert third == [[5, 6, 2]], "a start before the known end cuts the old tail"
    ledger.release([2, 99])
    assert ledger.num_live == 1 and ledger.context(1) == [5, 6, 2]


@pytest.mark.parametrize(
    ("ids", "rows", "lengths", "starts", "message"),
    [
        ([1, 1], [[1], [2]], [1, 1], [0, 0], "distinct"),
        ([1, 2, 3], [[1], [2], [3]], [1, 1, 1], [0, 0, 0], "exceed max_sequences"),
        ([1], [[1, 2]], [3], [0], "input_length 3 outside"),
        ([1], [[1]], [0], [0], "input_length 0 outside"),
        ([7], [[1]], [1], [1], "start_position 1 outside 0..0"),
        ([1], [[1] * 5], [5], [0], "exceed 4"),
    ],
)
def test_ledger_rejects_bad_steps_without_changing(ids, rows, lengths, starts, message) -> None:
    ledger = ContextLedger(max_sequences=2, max_length=4)
    with pytest.raises(ValueError, match=message):
        ledger.update(torch.tensor(ids), torch.tensor(rows), torch.tensor(lengths),
                      torch.tensor(starts))  # fmt: skip
    assert ledger.num_live == 0


def test_ledger_checks_its_limits_and_shapes() -> None:
    with pytest.raises(ValueError, match="must be >= 1"):
        ContextLedger(0, 4)
    with pytest.raises(ValueError, match="input_ids must have shape"):
        ContextLedger(1, 4).update(torch.tensor([1]), torch.tensor([1]), torch.tensor([1]),
                                   torch.tensor([0]))  # fmt: skip


def answer(tokens: list[int], width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    width = width or len(tokens)
    out = np.full((1, 1, width), -1, dtype=np.int32)
    out[0, 0, : len(tokens)] = tokens
    return out, np.asarray([[len(tokens)]], dtype=np.int32)


def test_parse_all_accepted_plus_bonus() -> None:
    assert parse_response(*answer([4, 5, 6]), drafts=[4, 5]) == ([4, 5, 6], 2)


def test_parse_rejection_discards_tokens_generated_after_the_correction() -> None:
    assert parse_response(*answer([4, 9, 5, 1]), drafts=[4, 5, 6]) == ([4, 9], 1)
    assert parse_response(*answer([3], width=4), drafts=[4]) == ([3], 0)
    assert parse_response(*answer([2]), drafts=[]) == ([2], 0)


@pytest.mark.parametrize(
    ("output_ids", "lengths", "message"),
    [
        (np.zeros((1, 3), np.int32), np.ones((1, 1), np.int32), "must be \\[1, beam, tokens\\]"),
        (np.zeros((2, 1, 3), np.int32), np.ones((2, 1), np.int32), "one request"),
        (np.zeros((1, 1, 3), np.int32), np.full((1, 1), 4, np.int32), "outside 1..3"),
        (np.zeros((1, 1, 3), np.int32), np.zeros((1, 1), np.int32), "outside 1..3"),
    ],
)
def test_parse_rejects_malformed_answers(output_ids, lengths, message) -> None:
    with pytest.raises(ValueError, match=message):
        parse_response(output_ids, lengths, drafts=[1])


def test_parse_rejects_an_answer_without_correction_token() -> None:
    with pytest.raises(ValueError, match="no correction or bonus token"):
        parse_response(*answer([4, 5]), drafts=[4, 5, 6])


def test_gather_pads_to_k_plus_one() -> None:
    output_ids, num_accepted = gather_outputs([([4, 9], 1), ([2], 0)], max_draft_tokens=3)
    assert output_ids.tolist() == [[4, 9, 0, 0], [2, 0, 0, 0]]
    assert output_ids.dtype == torch.int32 and num_accepted.tolist() == [1, 0]
    with pytest.raises(ValueError, match="row 0"):
        gather_outputs([([4, 9], 0)], max_draft_tokens=3)
    with pytest.raises(ValueError, match="row 0"):
        gather_outputs([([1, 2, 3], 2)], max_draft_tokens=1)
