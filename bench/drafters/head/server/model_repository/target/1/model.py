"""Triton adapter of the target stage: StepInputs + drafts in, verified tokens out."""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.triton_model import StageModel


class TritonPythonModel(StageModel):
    STAGE = "target"
    pb = pb_utils
