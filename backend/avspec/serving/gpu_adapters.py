"""The Triton-free bodies of the GPU `model_gpu.py` / `trtllm_target` adapters.

The CPU adapters (avspec.serving.adapters) take and return numpy arrays. On the GPU path
(`--model-config-name=gpu`, parameter FORCE_CPU_ONLY_INPUT_TENSORS "no") a model may receive
device tensors and returns device tensors through DLPack, so these helpers take and return torch
tensors and leave each one on the device it lives on:

- the scheduler's bookkeeping vectors arrive on the CPU and stay there (the stages read them on
  the host by design, and the verifier matches sequences by id on the host);
- drafts, draft probabilities, features and num_verify live on the GPU between models.

`TrtllmTargetAdapter` is the fan-out / gather of the TensorRT-LLM target (avspec.trtllm.request);
its model.py only sends the requests and collects the answers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from avspec.av.estimator import accepted_counts
from avspec.contract import StepInputs, base_tokens
from avspec.serving.adapters import VerifierAdapter, VerifierStepStats
from avspec.serving.repository import STEP_INPUT_DTYPES
from avspec.trtllm.request import (
    ContextLedger,
    TargetRequest,
    build_requests,
    gather_outputs,
    parse_response,
)

# Parameters read by the Python backend itself, not by our adapters' parameter parsers.
BACKEND_PARAMETERS = ("FORCE_CPU_ONLY_INPUT_TENSORS",)

_TORCH_DTYPES = {
    np.int64: torch.int64,
    np.int32: torch.int32,
    np.bool_: torch.bool,
    np.float32: torch.float32,
}


def without_backend_parameters(args: Mapping[str, str]) -> dict[str, str]:
    """Triton's `initialize` args with BACKEND_PARAMETERS removed from the model config JSON.

    The CPU adapters parse their `parameters` block strictly (unknown keys fail), so the GPU
    variants hand them the config without the keys only the backend reads.
    """
    config = json.loads(args["model_config"])
    params = config.get("parameters", {})
    config["parameters"] = {k: v for k, v in params.items() if k not in BACKEND_PARAMETERS}
    return {**args, "model_config": json.dumps(config)}


def tensor_from_pb(tensor: Any) -> torch.Tensor:
    """A torch view of a `pb_utils.Tensor`: CPU through numpy, device memory through DLPack."""
    if tensor.is_cpu():
        return torch.from_numpy(np.ascontiguousarray(tensor.as_numpy()))
    return torch.utils.dlpack.from_dlpack(tensor.to_dlpack())


def step_inputs_from_tensors(tensors: Mapping[str, torch.Tensor]) -> StepInputs:
    """StepInputs from torch tensors named like its fields (dtypes converted, devices kept)."""
    missing = sorted(set(STEP_INPUT_DTYPES) - set(tensors))
    if missing:
        raise ValueError(f"missing step input(s): {', '.join(missing)}")
    return StepInputs(
        **{
            name: tensors[name].to(_TORCH_DTYPES[dtype])
            for name, dtype in STEP_INPUT_DTYPES.items()
        }
    )


def run_draft(stage: Any, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Run a DraftStage on the step inputs; outputs stay on the stage's device."""
    out = stage(step_inputs_from_tensors(tensors))
    return {
        "draft_tokens": out.draft_tokens,
        "draft_probs": out.draft_probs,
        "draft_features": out.draft_features,
    }


def run_verifier(
    adapter: VerifierAdapter, tensors: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], VerifierStepStats]:
    """One verifier step with device tensors; num_verify stays on the estimator's device.

    The step itself does not sync the host when seq ids arrive on the CPU (checked on a GPU by
    client/gpu_check.py); the metrics read three device scalars with one copy afterwards, the
    one host read of this model per step (the TensorRT-LLM fan-out reads num_verify anyway).
    """
    device = adapter.device

    def on_device(name: str, dtype: torch.dtype) -> torch.Tensor:
        return tensors[name].to(device=device, dtype=dtype)

    prev_num_accepted = on_device("prev_num_accepted", torch.int32)
    refits = adapter.estimator.num_refits
    decision = adapter.verifier.step(
        seq_ids=tensors["seq_ids"].cpu().long(),
        features=on_device("draft_features", torch.float32),
        num_draft_tokens=on_device("num_draft_tokens", torch.int32),
        adaptive=on_device("adaptive", torch.bool),
        prev_num_accepted=prev_num_accepted,
        release_seq_ids=tensors["release_seq_ids"].cpu().long(),
        base_tokens=base_tokens(tensors["input_lengths"].cpu(), tensors["reusable"].cpu()),
    )
    refitted = adapter.estimator.num_refits != refits
    if refitted:
        adapter.save_snapshot()
    drafted, verified, budget, accepted = torch.stack(
        [
            decision.drafted,
            decision.verified,
            decision.budget,
            accepted_counts(prev_num_accepted)[0].long().sum(),
        ]
    ).tolist()
    stats = VerifierStepStats(
        batch_size=int(tensors["seq_ids"].shape[0]),
        drafted=drafted,
        verified=verified,
        accepted=accepted,
        trimmed=drafted - verified,
        budget_fraction=budget / drafted if drafted else None,
        refitted=refitted,
    )
    return {"num_verify": decision.num_verify}, stats


@dataclass(frozen=True)
class TrtllmTargetParams:
    """Parameters of the `trtllm_target` model (GPU repository)."""

    vocab_size: int  # the engine's vocabulary (draft_logits width); the draft's must not exceed it
    trtllm_model: str = "tensorrt_llm"  # the tensorrtllm-backend model called per sequence
    max_draft_tokens: int = 8  # K: the contract's output width is K + 1; <= engine max_draft_len
    max_sequences: int = 128  # live sequences whose context is kept
    max_length: int = 4096  # committed tokens per sequence
    use_draft_logits: bool = True  # send draft_logits (probabilistic acceptance) when sampling

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_draft_tokens", "max_sequences", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


class TrtllmTargetAdapter:
    """Fan-out of a step to one TensorRT-LLM request per sequence, and gather of the answers."""

    def __init__(self, params: TrtllmTargetParams) -> None:
        self.params = params
        self.ledger = ContextLedger(params.max_sequences, params.max_length)

    @property
    def live_sequences(self) -> int:
        """Sequences whose context is held (the av_kv_live_sequences{model="target"} gauge)."""
        return self.ledger.num_live

    def prepare(self, tensors: Mapping[str, torch.Tensor]) -> list[TargetRequest]:
        """Release, record the new committed tokens, and build the requests in batch order."""
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
            tensors["temperature"].cpu(),
            tensors["top_p"].cpu(),
            tensors["random_seed"].cpu(),
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
        return {"output_ids": output_ids, "num_accepted": num_accepted}
