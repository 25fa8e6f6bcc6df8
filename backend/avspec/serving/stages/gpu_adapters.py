"""The Triton-free body of the GPU repository's `trtllm_target` model (docs/gpu.md).

The draft and the verifier run on the GPU through the same adapters as on the CPU
(avspec.serving.stages.adapters; their `model_gpu.py` only keeps outputs on the device). What
the GPU deployment adds is the TensorRT-LLM target: `TrtllmTargetAdapter` fans a step out to one
TensorRT-LLM request per sequence and gathers the answers (avspec.trtllm.request); its model.py
only sends the requests and collects the answers. Inputs arrive as torch tensors and stay on
their device: the scheduler's bookkeeping vectors on the CPU, drafts and q on the GPU.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from avspec.contract import no_features
from avspec.serving.repository import TrtllmTargetParams
from avspec.trtllm.request import (
    ContextLedger,
    RowSampling,
    TargetRequest,
    build_requests,
    gather_outputs,
    parse_response,
)


class TrtllmTargetAdapter:
    """Fan-out of a step to one TensorRT-LLM request per sequence, and gather of the answers."""

    def __init__(self, params: TrtllmTargetParams) -> None:
        self.params = params
        self.ledger = ContextLedger(params.max_sequences, params.max_length)
        self._started = time.perf_counter()

    @property
    def live_sequences(self) -> int:
        """Sequences whose context is held (the av_kv_live_sequences{model="target"} gauge)."""
        return self.ledger.num_live

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> list[TargetRequest]:
        """Release, record the new committed tokens, and build the requests in batch order."""
        self._started = time.perf_counter()
        k = self.params.max_draft_tokens
        draft_tokens = tensors["draft_tokens"]
        if draft_tokens.dim() != 2 or draft_tokens.shape[1] != k:
            raise ValueError(f"draft_tokens must be [batch, {k}], got {tuple(draft_tokens.shape)}")
        self.ledger.release(tensors["release_seq_ids"].cpu().tolist())
        seq_ids = tensors["seq_ids"].cpu()
        contexts = self.ledger.update(
            seq_ids,
            tensors["input_ids"].cpu(),
            tensors["input_lengths"].cpu(),
            tensors["start_positions"].cpu(),
        )
        return build_requests(
            seq_ids,
            contexts,
            draft_tokens,
            tensors["draft_probs"],
            tensors["num_verify"].cpu(),
            RowSampling(
                tensors["temperature"].cpu(), tensors["top_p"].cpu(), tensors["random_seed"].cpu()
            ),
            self.params.vocab_size,
            self.params.use_draft_logits,
        )

    def finish(
        self,
        requests: Sequence[TargetRequest],
        answers: Sequence[tuple[np.ndarray, np.ndarray]],
    ) -> dict[str, torch.Tensor]:
        """Gather (output_ids, sequence_length) answers, in request order, into the contract."""
        if len(answers) != len(requests):
            raise ValueError(f"{len(answers)} answers for {len(requests)} requests")
        results = [
            parse_response(output_ids, lengths, request.drafts)
            for request, (output_ids, lengths) in zip(requests, answers, strict=True)
        ]
        output_ids, num_accepted = gather_outputs(results, self.params.max_draft_tokens)
        # Host wall time from prepare to the last answer (the cost refresh reads it).
        target_ms = torch.tensor([(time.perf_counter() - self._started) * 1e3])
        # No features for a draft head (not yet run on a GPU): the tensorrt_llm backend returns
        # no hidden states per verified token. The way there is an engine built with EAGLE's
        # own heads (TensorRT-LLM's speculative decoding mode `eagle`), or one whose output
        # layer is left out so its "logits" output is the last hidden state; until then the
        # head drafter is served on the CPU target, and the GPU target emits nothing.
        return {
            "output_ids": output_ids, "num_accepted": num_accepted, "target_ms": target_ms,
            **no_features(),
        }  # fmt: skip
