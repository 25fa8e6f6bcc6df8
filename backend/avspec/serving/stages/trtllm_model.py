"""The Triton model of the TensorRT-LLM target (GPU only; written and tested on the CPU with a
stand-in for Triton, never run on a GPU): fan a step out per sequence, gather the answers.

One BLS request to the `tensorrt_llm` model per sequence, all in flight at once
(`asyncio.gather`), so the engine's batch manager sees the whole step together. Building the
requests and reading the answers is Triton-free (`gpu_adapters.TrtllmTargetAdapter`); `pb` is
`triton_python_backend_utils`, passed in by the repository's thin `model.py`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from torch.utils.dlpack import to_dlpack

from avspec.config import from_parameters
from avspec.serving.stages.gpu_adapters import TrtllmTargetAdapter, TrtllmTargetParams
from avspec.serving.stages.triton_model import (
    adapter_parameters,
    host_output_tensors,
    input_names,
    input_tensors,
    kv_live_gauge,
    respond_each_async,
    tensor_from_pb,
)
from avspec.trtllm.request import TRTLLM_OUTPUTS, TargetRequest

STAGE = "target"


class TrtllmTargetModel:
    """Triton's `TritonPythonModel` of `trtllm_target`; set pb."""

    pb: ClassVar[Any]

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        self.params = from_parameters(TrtllmTargetParams, adapter_parameters(config))
        self.input_names = input_names(config)
        self.adapter = TrtllmTargetAdapter(self.params)
        self.kv_family, self.kv_live = kv_live_gauge(self.pb, STAGE)

    async def execute(self, requests: list[Any]) -> list[Any]:
        responses = await respond_each_async(self.pb, requests, self._outputs, "trtllm_target")
        self.kv_live.set(self.adapter.live_sequences)
        return responses

    async def _outputs(self, request: Any) -> list[Any]:
        prepared = self.adapter.prepare(input_tensors(self.pb, request, self.input_names))
        answers = await asyncio.gather(*(self.send(r) for r in prepared))
        return host_output_tensors(self.pb, self.adapter.finish(prepared, answers))

    async def send(self, prepared: TargetRequest) -> tuple[Any, ...]:
        """One sequence's request to the engine; its TRTLLM_OUTPUTS as numpy arrays."""
        pb = self.pb
        inputs = [pb.Tensor(name, array) for name, array in prepared.host.items()]
        if prepared.draft_logits is not None:
            logits = to_dlpack(prepared.draft_logits.contiguous())
            inputs.append(pb.Tensor.from_dlpack("draft_logits", logits))
        response = await pb.InferenceRequest(
            model_name=self.params.trtllm_model,
            inputs=inputs,
            requested_output_names=list(TRTLLM_OUTPUTS),
        ).async_exec()
        if response.has_error():
            raise RuntimeError(f"{self.params.trtllm_model}: {response.error().message()}")
        return tuple(
            tensor_from_pb(pb.get_output_tensor_by_name(response, name)).cpu().numpy()
            for name in TRTLLM_OUTPUTS
        )
