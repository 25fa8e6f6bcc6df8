"""The TensorRT-LLM target's fan-out and gather, run on the CPU with torch tensors.

The draft and verifier models of the GPU deployment run the shared adapters
(tests/unit/serving/test_adapters.py). The fan-out is checked against the CPU target stage: a fake
engine that verifies greedily with the target model (and, like the real engine, keeps generating
after a rejection) must give the same output_ids / num_accepted as avspec.engine.target_stage on
the same step.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.stages import (
    K,
    make_draft_stage,
    make_inputs,
    make_target_stage,
    perturbed,
    tiny_model,
)

from avspec.serving.stages.gpu_adapters import TrtllmTargetAdapter, TrtllmTargetParams

pytestmark = pytest.mark.usefixtures("single_thread")


def greedy_engine(model, context: list[int], drafts: list[int], output_len: int, junk: int = 2):
    """What a greedy draft_tokens_external engine answers (input excluded from the output)."""
    tokens: list[int] = []
    while len(tokens) < output_len:
        logits = model(torch.tensor([context + tokens]))[0, -1]
        tokens.append(int(logits.argmax()))
        position = len(tokens) - 1
        if position < len(drafts) and tokens[-1] != drafts[position]:
            tokens += [junk] * (output_len - len(tokens))  # generation goes on after a rejection
            break
    out = np.asarray([[tokens]], dtype=np.int32)
    return out, np.asarray([[len(tokens)]], dtype=np.int32)


def test_fan_out_and_gather_equal_the_cpu_target_stage_when_greedy() -> None:
    target = tiny_model(0)
    draft = perturbed(target, 0.5, 1)
    adapter = TrtllmTargetAdapter(TrtllmTargetParams(vocab_size=target.config.vocab_size,
                                                     max_draft_tokens=K))  # fmt: skip
    stage = make_target_stage(target)
    drafter = make_draft_stage(draft)
    rows = [{"seq_id": i, "tokens": [3 + i, 7, 1 + i], "temperature": 0.0} for i in range(3)]
    inputs = make_inputs(rows)
    for _ in range(3):  # three steps: contexts grow through the ledger
        drafted = drafter(inputs)
        num_verify = torch.tensor([K, 2, 0], dtype=torch.int32)
        tensors = dict(inputs.as_dict(), draft_tokens=drafted.draft_tokens,
                       draft_probs=drafted.draft_probs, num_verify=num_verify)  # fmt: skip
        requests = adapter.prepare(tensors)
        answers = [
            greedy_engine(
                target,
                r.host["input_ids"][0].tolist(),
                r.drafts,
                int(r.host["request_output_len"][0, 0]),
            )  # fmt: skip
            for r in requests
        ]
        got = adapter.finish(requests, answers)
        want = stage(inputs, drafted.draft_tokens, drafted.draft_probs, num_verify)
        assert got["num_accepted"].tolist() == want.num_accepted.tolist()
        for row, a in enumerate(want.num_accepted.tolist()):
            assert (
                got["output_ids"][row, : a + 1].tolist() == want.output_ids[row, : a + 1].tolist()
            )
        rows = [
            {"seq_id": r["seq_id"], "tokens": got["output_ids"][i, : a + 1].tolist(),
             "start": int(inputs.start_positions[i] + inputs.input_lengths[i]),
             "reusable": a, "temperature": 0.0}
            for i, (r, a) in enumerate(zip(rows, got["num_accepted"].tolist(), strict=True))
        ]  # fmt: skip
        inputs = make_inputs(rows, prev=got["num_accepted"].tolist())
    assert adapter.live_sequences == 3


def test_prepare_releases_and_checks_k() -> None:
    adapter = TrtllmTargetAdapter(TrtllmTargetParams(vocab_size=16, max_draft_tokens=K))
    inputs = make_inputs([{"seq_id": 1, "tokens": [3]}], release=[1])
    tensors = dict(inputs.as_dict(), draft_tokens=torch.zeros(1, K, dtype=torch.int32),
                   draft_probs=torch.full((1, K, 16), 1 / 16),
                   num_verify=torch.zeros(1, dtype=torch.int32))  # fmt: skip
    assert len(adapter.prepare(tensors)) == 1 and adapter.live_sequences == 1
    tensors["draft_tokens"] = torch.zeros(1, K + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"draft_tokens must be \\[batch, {K}\\]"):
        adapter.prepare(tensors)
    with pytest.raises(ValueError, match="0 answers for 1 requests"):
        adapter.finish([object()], [])


def test_trtllm_target_params_validate() -> None:
    with pytest.raises(ValueError, match="vocab_size must be >= 1"):
        TrtllmTargetParams(vocab_size=0)
