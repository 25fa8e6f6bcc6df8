"""Triton adapter of the entry model: text in, text out, in-flight batching of every request
(avspec.serving.stages.entry_model)."""

import triton_python_backend_utils as pb_utils

from avspec.serving.stages.entry_model import EntryModel


class TritonPythonModel(EntryModel):
    pb = pb_utils
