"""The `speculative` model's input tensors as a Triton client sends them.

Names and types are the front's generate schema (avspec.serving.front.schema, which a unit test
keeps in step with model_repository/speculative/config.pbtxt): one source, so a client cannot
send a type the model does not declare. numpy dtypes are tritonclient's for each datatype.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType, ModuleType

import numpy as np
from tritonclient.utils import triton_to_np_dtype

from avspec.serving.front.schema import DEFAULT_GENERATE_SCHEMA

MODEL = "speculative"


def client_datatype(config_type: str) -> str:
    """The tritonclient datatype of a config.pbtxt data_type: TYPE_STRING -> BYTES, TYPE_X -> X."""
    return "BYTES" if config_type == "TYPE_STRING" else config_type.removeprefix("TYPE_")


# input name -> tritonclient datatype, every input of `speculative` in config order
SPECULATIVE_INPUTS: Mapping[str, str] = MappingProxyType(
    {name: client_datatype(spec.dtype) for name, spec in DEFAULT_GENERATE_SCHEMA.items()}
)


def infer_inputs(client: ModuleType, values: Mapping[str, object]) -> list:
    """One InferInput of `client` (tritonclient.grpc or .http) per input value: shape [1], or
    [n] for a list (`plain_spans`).

    Strings are sent UTF-8 encoded. ValueError naming the input if it is not one of the model's.
    """
    inputs = []
    for name, value in values.items():
        if name not in SPECULATIVE_INPUTS:
            known = ", ".join(SPECULATIVE_INPUTS)
            raise ValueError(f"{name!r} is not an input of {MODEL} (inputs: {known})")
        datatype = SPECULATIVE_INPUTS[name]
        encoded = value.encode() if isinstance(value, str) else value
        items = list(encoded) if isinstance(encoded, list | tuple) else [encoded]
        array = np.array(items, dtype=triton_to_np_dtype(datatype))
        tensor = client.InferInput(name, [len(items)], datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs
