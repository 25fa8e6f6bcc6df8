"""GPU variant of the verifier adapter (configs/gpu.pbtxt): features in, num_verify out on cuda.

The CPU model's class (VerifierModel: the same VerifierAdapter, metrics, warm start) with one
difference: num_verify stays on the device (avspec.serving.stages.triton_model.DeviceOutputs).
"""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.triton_model import DeviceOutputs, VerifierModel


class TritonPythonModel(DeviceOutputs, VerifierModel):
    pb = pb_utils
