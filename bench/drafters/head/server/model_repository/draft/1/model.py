"""Triton adapter of the draft stage: StepInputs in, drafts out
(avspec.serving.stages.triton_model)."""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.triton_model import StageModel


class TritonPythonModel(StageModel):
    STAGE = "draft"
    pb = pb_utils
