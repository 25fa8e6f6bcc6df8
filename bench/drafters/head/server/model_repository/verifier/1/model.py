"""Triton adapter of the adaptive verifier: features in, num_verify out, av_* metrics exported.

The estimator lives in this instance; it is restored from snapshot_path on initialize (warm
start) and saved at every refit and in finalize (avspec.serving.stages.triton_model.VerifierModel).
"""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.triton_model import VerifierModel


class TritonPythonModel(VerifierModel):
    pb = pb_utils
