"""GPU variant of the verifier adapter (configs/gpu.pbtxt): features in, num_verify out on cuda.

initialize, metrics and finalize are the CPU adapter's (VerifierModel); only the tensor
hand-over differs (avspec.serving.gpu_adapters.run_verifier).
"""

import triton_python_backend_utils as pb_utils

from avspec.serving.gpu_adapters import run_verifier, without_backend_parameters
from avspec.serving.triton_model import VerifierModel, dlpack_output_tensors, input_tensors


class TritonPythonModel(VerifierModel):
    pb = pb_utils

    def initialize(self, args):
        super().initialize(without_backend_parameters(args))

    def request_outputs(self, request):
        tensors = input_tensors(pb_utils, request, self.input_names)
        outputs, stats = run_verifier(self.adapter, tensors)
        self.publish_step(stats)
        return dlpack_output_tensors(pb_utils, outputs)
