"""GPU variant of the draft adapter (configs/gpu.pbtxt): device tensors out through DLPack.

The CPU model's class (StageModel, the same DraftAdapter on cuda) with one difference: its
outputs stay on the device (avspec.serving.stages.triton_model.DeviceOutputs).
"""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.triton_model import DeviceOutputs, StageModel


class TritonPythonModel(DeviceOutputs, StageModel):
    STAGE = "draft"
    pb = pb_utils
