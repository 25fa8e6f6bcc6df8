"""GPU variant of the verifier adapter (configs/gpu.pbtxt): features in, num_verify out on cuda.

initialize, metrics and finalize are the CPU adapter's, loaded from model.py beside this file;
only the tensor hand-over differs (avspec.serving.gpu_adapters.run_verifier).
"""

import importlib.util
from pathlib import Path

import triton_python_backend_utils as pb_utils
from torch.utils.dlpack import to_dlpack

from avspec.serving.gpu_adapters import run_verifier, tensor_from_pb, without_backend_parameters


def _cpu_model_class():
    path = Path(__file__).with_name("model.py")
    spec = importlib.util.spec_from_file_location("avspec_verifier_cpu_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TritonPythonModel


class TritonPythonModel(_cpu_model_class()):
    def initialize(self, args):
        super().initialize(without_backend_parameters(args))

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                tensors = {
                    name: tensor_from_pb(pb_utils.get_input_tensor_by_name(request, name))
                    for name in self.input_names
                }
                outputs, stats = run_verifier(self.adapter, tensors)
                self._publish_step(stats)
                out = [
                    pb_utils.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))
                    for name, value in outputs.items()
                ]
                responses.append(pb_utils.InferenceResponse(output_tensors=out))
            except Exception as err:  # noqa: BLE001 - one request's failure is its own response
                message = f"verifier: {type(err).__name__}: {err}"
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
        return responses
