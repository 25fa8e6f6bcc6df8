"""avspec.tools.bench.soak.tensors: the input table follows config.pbtxt; InferInputs from
values.
"""

from __future__ import annotations

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
from helpers import ROOT

from avspec.serving.front.schema import generate_schema_from_config
from avspec.tools.bench.soak.tensors import SPECULATIVE_INPUTS, client_datatype, infer_inputs


def test_inputs_are_those_of_the_served_config():
    config = (ROOT / "model_repository" / "speculative" / "config.pbtxt").read_text()
    declared = generate_schema_from_config(config)
    assert SPECULATIVE_INPUTS == {
        "text_input": "BYTES",
        "max_tokens": "INT32",
        "temperature": "FP32",
        "top_p": "FP32",
        "random_seed": "UINT64",
        "stream": "BOOL",
        "num_draft_tokens": "INT32",
        "adaptive_verification": "BOOL",
        "adaptive_drafting": "BOOL",
        "ignore_eos": "BOOL",
        "plain_spans": "INT32",
    }
    assert {n: client_datatype(s.dtype) for n, s in declared.items()} == SPECULATIVE_INPUTS


@pytest.mark.parametrize("client", [grpcclient, httpclient], ids=["grpc", "http"])
def test_infer_inputs(client):
    values = {"text_input": "héllo", "max_tokens": 7, "random_seed": 2**40, "stream": True}
    inputs = infer_inputs(client, values)
    assert [t.name() for t in inputs] == list(values)
    assert [t.datatype() for t in inputs] == ["BYTES", "INT32", "UINT64", "BOOL"]
    assert all(t.shape() == [1] for t in inputs)


def test_infer_inputs_sends_the_values_in_their_dtypes():
    seen = {}

    class Recorder:
        def __init__(self, name, shape, datatype):
            self.name = name

        def set_data_from_numpy(self, array):
            seen[self.name] = array

    class FakeClient:
        InferInput = Recorder

    infer_inputs(FakeClient, {"text_input": "é", "temperature": 0.7, "random_seed": 2**63})
    assert seen["text_input"].dtype == object and seen["text_input"][0] == "é".encode()
    assert seen["temperature"].dtype == np.float32
    assert seen["random_seed"].dtype == np.uint64 and seen["random_seed"][0] == 2**63


def test_infer_inputs_refuses_an_unknown_input():
    with pytest.raises(ValueError, match="'max_new_tokens' is not an input of speculative"):
        infer_inputs(grpcclient, {"text_input": "a", "max_new_tokens": 3})
