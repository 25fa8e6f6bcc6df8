"""Triton adapter of the TensorRT-LLM target: fan a step out per sequence, gather the answers.

One BLS request to the tensorrt_llm model per sequence, all in flight at once (asyncio.gather),
so the engine's batch manager sees the whole step together. Building the requests and reading
the answers is Triton-free (avspec.serving.stages.gpu_adapters.TrtllmTargetAdapter).
"""

import asyncio
import json

import triton_python_backend_utils as pb_utils
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
from avspec.trtllm.request import TRTLLM_OUTPUTS

STAGE = "target"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.params = from_parameters(TrtllmTargetParams, adapter_parameters(config))
        self.input_names = input_names(config)
        self.adapter = TrtllmTargetAdapter(self.params)
        self.kv_family, self.kv_live = kv_live_gauge(pb_utils, STAGE)

    async def execute(self, requests):
        responses = await respond_each_async(pb_utils, requests, self._outputs, "trtllm_target")
        self.kv_live.set(self.adapter.live_sequences)
        return responses

    async def _outputs(self, request):
        prepared = self.adapter.prepare(input_tensors(pb_utils, request, self.input_names))
        answers = await asyncio.gather(*(self._send(r) for r in prepared))
        outputs = self.adapter.finish(prepared, answers)
        return host_output_tensors(pb_utils, outputs)

    async def _send(self, prepared):
        inputs = [pb_utils.Tensor(name, array) for name, array in prepared.host.items()]
        if prepared.draft_logits is not None:
            logits = to_dlpack(prepared.draft_logits.contiguous())
            inputs.append(pb_utils.Tensor.from_dlpack("draft_logits", logits))
        response = await pb_utils.InferenceRequest(
            model_name=self.params.trtllm_model,
            inputs=inputs,
            requested_output_names=list(TRTLLM_OUTPUTS),
        ).async_exec()
        if response.has_error():
            raise RuntimeError(f"{self.params.trtllm_model}: {response.error().message()}")
        return tuple(
            tensor_from_pb(pb_utils.get_output_tensor_by_name(response, name)).cpu().numpy()
            for name in TRTLLM_OUTPUTS
        )
