"""Triton adapter of the draft stage: StepInputs in, drafts out (avspec.serving.adapters)."""

import json

import triton_python_backend_utils as pb_utils

from avspec.serving import repository
from avspec.serving.adapters import StageAdapter
from avspec.serving.metrics import KV_LIVE_SEQUENCES

STAGE = "draft"


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = repository.parse_parameters(
            repository.StageParams, repository.model_parameters(config)
        )
        root = repository.project_root(args["model_repository"])
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.adapter = StageAdapter(STAGE, params, root)
        # The family must stay referenced, or its metrics die with it (shared/design/triton.md).
        self.kv_family = pb_utils.MetricFamily(
            name=KV_LIVE_SEQUENCES.name,
            description=KV_LIVE_SEQUENCES.description,
            kind=pb_utils.MetricFamily.GAUGE,
        )
        self.kv_live = self.kv_family.Metric(labels={"model": STAGE})
        self.kv_live.set(0)

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                arrays = {
                    name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in self.input_names
                }
                outputs = self.adapter(arrays)
                tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as err:  # noqa: BLE001 - one request's failure is its own response
                message = f"{STAGE}: {type(err).__name__}: {err}"
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
        self.kv_live.set(self.adapter.live_sequences)
        return responses
