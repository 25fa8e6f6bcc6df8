"""The model classes and helpers behind the model.py files, with a fake `pb_utils` (no server)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import torch

from avspec.serving import metrics
from avspec.serving.triton_model import (
    StageModel,
    dlpack_output_tensors,
    input_arrays,
    input_names,
    input_tensors,
    kv_live_gauge,
    make_metric_family,
    respond_each,
    respond_each_async,
)


class FakeMetric:
    def __init__(self, labels: dict) -> None:
        self.labels = labels
        self.value = None

    def set(self, value: float) -> None:
        self.value = value


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "C", "G", "H"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict) -> FakeMetric:  # noqa: N802 - pb_utils' spelling
        return FakeMetric(labels)


class FakeResponse:
    def __init__(self, output_tensors: list | None = None, error: str | None = None) -> None:
        self.output_tensors, self.error = output_tensors, error


class FakeTensor:
    def __init__(self, name: str, value) -> None:
        self.name, self.value = name, value

    @classmethod
    def from_dlpack(cls, name: str, capsule) -> FakeTensor:
        return cls(name, torch.utils.dlpack.from_dlpack(capsule))


class FakeInput:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def as_numpy(self) -> np.ndarray:
        return self.array

    def is_cpu(self) -> bool:
        return True


pb = SimpleNamespace(
    MetricFamily=FakeFamily,
    InferenceResponse=FakeResponse,
    TritonError=lambda message: message,
    Tensor=FakeTensor,
    get_input_tensor_by_name=lambda request, name: FakeInput(request[name]),
)


def double(request: dict) -> list:
    if "x" not in request:
        raise KeyError("x")
    return [FakeTensor("y", request["x"] * 2)]


def test_make_metric_family_maps_kinds() -> None:
    family = make_metric_family(pb, metrics.ESTIMATOR_REFITS)
    assert (family.name, family.kind) == (metrics.ESTIMATOR_REFITS.name, "C")
    assert make_metric_family(pb, metrics.STEP_BATCH_SIZE).kind == "H"


def test_kv_live_gauge_is_labelled_and_zero() -> None:
    family, gauge = kv_live_gauge(pb, "draft")
    assert family.name == metrics.KV_LIVE_SEQUENCES.name
    assert (gauge.labels, gauge.value) == ({"model": "draft"}, 0)


def test_inputs_and_outputs_round_trip() -> None:
    names = input_names({"input": [{"name": "a"}, {"name": "b"}]})
    request = {"a": np.array([1]), "b": np.array([2.0])}
    assert input_arrays(pb, request, names) == request
    assert torch.equal(input_tensors(pb, request, names)["a"], torch.tensor([1]))
    (out,) = dlpack_output_tensors(pb, {"z": torch.arange(3).t()})
    assert out.name == "z" and torch.equal(out.value, torch.arange(3))


def test_respond_each_answers_a_failed_request_with_its_own_error() -> None:
    good, bad = {"x": 2}, {}
    responses = respond_each(pb, [good, bad, good], double, "draft")
    assert [r.output_tensors[0].value for r in (responses[0], responses[2])] == [4, 4]
    assert responses[1].error == "draft: KeyError: 'x'"


def test_respond_each_async_answers_a_failed_request_with_its_own_error() -> None:
    async def outputs(request: dict) -> list:
        return double(request)

    responses = asyncio.run(respond_each_async(pb, [{}, {"x": 1}], outputs, "trtllm_target"))
    assert responses[0].error == "trtllm_target: KeyError: 'x'"
    assert responses[1].output_tensors[0].value == 2


def test_stage_model_execute_updates_the_live_gauge() -> None:
    model = type("Model", (StageModel,), {"STAGE": "target", "pb": pb})()
    model.adapter = SimpleNamespace(live_sequences=3)
    model.request_outputs = double  # the adapter's own call is covered in test_adapters
    model.kv_family, model.kv_live = kv_live_gauge(pb, "target")
    responses = model.execute([{"x": 1}, {}])
    assert responses[1].error == "target: KeyError: 'x'"
    assert model.kv_live.value == 3
