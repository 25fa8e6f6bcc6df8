"""Triton adapter of the TensorRT-LLM target (avspec.serving.stages.trtllm_model)."""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.trtllm_model import TrtllmTargetModel


class TritonPythonModel(TrtllmTargetModel):
    pb = pb_utils
