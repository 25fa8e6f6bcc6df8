"""GPU variant of the draft adapter (configs/gpu.pbtxt): device tensors out through DLPack.

initialize (parameters, stage on cuda, metrics) is the CPU adapter's (StageModel); only the
tensor hand-over differs (avspec.serving.gpu_adapters).
"""

import triton_python_backend_utils as pb_utils

from avspec.serving.gpu_adapters import run_draft, without_backend_parameters
from avspec.serving.triton_model import StageModel, dlpack_output_tensors, input_tensors


class TritonPythonModel(StageModel):
    STAGE = "draft"
    pb = pb_utils

    def initialize(self, args):
        super().initialize(without_backend_parameters(args))

    def request_outputs(self, request):
        tensors = input_tensors(pb_utils, request, self.input_names)
        return dlpack_output_tensors(pb_utils, run_draft(self.adapter.stage, tensors))
