"""The model classes and helpers behind the model.py files, with a fake `pb_utils` (no server).

The CPU models and their GPU variants share one class each; what a GPU variant changes (outputs
through DLPack, device memory read through DLPack, backend-only parameters) is checked here on
CPU tensors.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.server import save_tiny_pair

from avspec.serving.repository import STEP_INPUT_DTYPES
from avspec.serving.stages import metrics
from avspec.serving.stages.heap import HeapTrimmer
from avspec.serving.stages.triton_model import (
    DeviceOutputs,
    StageModel,
    VerifierModel,
    adapter_parameters,
    device_output_tensors,
    host_output_tensors,
    input_names,
    input_tensors,
    kv_live_gauge,
    make_metric_family,
    respond_each,
    respond_each_async,
    tensor_from_pb,
)

K = 4


class FakeMetric:
    def __init__(self, labels: dict) -> None:
        self.labels = labels
        self.value = None
        self.observed: list[float] = []

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value = (self.value or 0) + value

    def observe(self, value: float) -> None:
        self.observed.append(value)


class FakeFamily:
    COUNTER, GAUGE, HISTOGRAM = "C", "G", "H"

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name, self.description, self.kind = name, description, kind

    def Metric(self, labels: dict, buckets: list | None = None) -> FakeMetric:  # noqa: N802
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
    """A pb_utils.Tensor in CPU memory (numpy) or, with on_device, in device memory (DLPack)."""

    def __init__(self, array: np.ndarray, on_device: bool = False) -> None:
        self.array, self.on_device = array, on_device

    def as_numpy(self) -> np.ndarray:
        return self.array

    def is_cpu(self) -> bool:
        return not self.on_device

    def to_dlpack(self):
        return torch.utils.dlpack.to_dlpack(torch.from_numpy(self.array))


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


def test_tensor_from_pb_reads_host_and_device_memory() -> None:
    array = np.arange(4, dtype=np.int32)
    host, device = FakeInput(array), FakeInput(array, on_device=True)
    assert torch.equal(tensor_from_pb(host), torch.arange(4, dtype=torch.int32))
    assert torch.equal(tensor_from_pb(device), torch.arange(4, dtype=torch.int32))


def test_inputs_and_outputs_round_trip() -> None:
    names = input_names({"input": [{"name": "a"}, {"name": "b"}]})
    request = {"a": np.array([1]), "b": np.array([2.0])}
    tensors = input_tensors(pb, request, names)
    assert torch.equal(tensors["a"], torch.tensor([1])) and tensors["b"].dtype == torch.float64
    (host,) = host_output_tensors(pb, {"y": torch.arange(6).reshape(2, 3).t()})
    assert isinstance(host.value, np.ndarray) and host.value.flags.c_contiguous
    np.testing.assert_array_equal(host.value, np.arange(6).reshape(2, 3).T)
    (out,) = device_output_tensors(pb, {"z": torch.arange(3).t()})
    assert out.name == "z" and torch.equal(out.value, torch.arange(3))


def test_adapter_parameters_drop_only_the_backend_parameters() -> None:
    config = {"name": "m", "parameters": {"device": {"string_value": "cuda"},
              "FORCE_CPU_ONLY_INPUT_TENSORS": {"string_value": "no"}}}  # fmt: skip
    assert adapter_parameters(config) == {"device": {"string_value": "cuda"}}
    assert adapter_parameters({"name": "m"}) == {}


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


def test_stage_model_execute_updates_the_live_gauge_and_trims_the_heap() -> None:
    model = type("Model", (StageModel,), {"STAGE": "target", "pb": pb})()
    model.adapter = SimpleNamespace(live_sequences=3)
    model.request_outputs = double  # the adapter's own call is covered in test_adapters
    model.kv_family, model.kv_live = kv_live_gauge(pb, "target")
    trims: list[int] = []
    model.heap = HeapTrimmer(2, trim=lambda: trims.append(1))
    responses = model.execute([{"x": 1}, {}])
    assert responses[1].error == "target: KeyError: 'x'"
    assert model.kv_live.value == 3
    model.execute([{}])
    assert trims == [1]  # every 2nd execute


VERIFIER_INPUTS = ("seq_ids", "draft_features", "num_draft_tokens", "adaptive",
                   "prev_num_accepted", "release_seq_ids", "input_lengths", "reusable",
                   "num_drafted", "adaptive_drafting", "prev_timing_ms")  # fmt: skip


def verifier_args(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Triton's initialize args of a verifier model whose parameters hold `extra`."""
    parameters = {"num_positions": str(K), "refit_interval": "1", "cost_tables": "",
                  "snapshot_path": str(tmp_path / "snap.json"), **extra}  # fmt: skip
    config = {
        "name": "verifier",
        "input": [{"name": name} for name in VERIFIER_INPUTS],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }
    return {"model_config": json.dumps(config), "model_repository": str(tmp_path / "r" / "v")}


def verifier_request() -> dict[str, np.ndarray]:
    return {
        "seq_ids": np.array([1, 2], dtype=np.int64),
        "draft_features": np.ones((2, K), dtype=np.float32),
        "num_draft_tokens": np.array([K, 2], dtype=np.int32),
        "adaptive": np.array([True, False]),
        "prev_num_accepted": np.zeros(0, dtype=np.int32),
        "release_seq_ids": np.zeros(0, dtype=np.int64),
        "input_lengths": np.array([3, 3], dtype=np.int32),
        "reusable": np.zeros(2, dtype=np.int32),
        "num_drafted": np.array([K, 2], dtype=np.int32),
        "adaptive_drafting": np.array([True, False]),
        "prev_timing_ms": np.zeros(0, dtype=np.float32),
    }


@pytest.mark.parametrize("gpu_variant", [False, True], ids=["model.py", "model_gpu.py"])
def test_verifier_model_answers_and_publishes_its_step(tmp_path: Path, gpu_variant: bool) -> None:
    """One class for both: the GPU variant (its backend parameter in the config) differs only
    in sending num_verify through DLPack."""
    bases = (DeviceOutputs, VerifierModel) if gpu_variant else (VerifierModel,)
    model = type("Model", bases, {"pb": pb})()
    extra = {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"} if gpu_variant else {}
    model.initialize(verifier_args(tmp_path, **extra))
    (response,) = model.execute([verifier_request()])
    num_verify, plan = response.output_tensors
    assert (num_verify.name, plan.name) == ("num_verify", "next_draft_plan")
    assert len(plan.value) == 4 + K
    assert isinstance(num_verify.value, torch.Tensor if gpu_variant else np.ndarray)
    assert num_verify.value.tolist()[1] == 2  # AV off for row 1: every draft verified
    assert model.metrics[metrics.DRAFTED_TOKENS.name].value == K + 2
    assert model.metrics[metrics.ESTIMATOR_REFITS.name].value == 1
    assert model.histograms[metrics.STEP_BATCH_SIZE.name].observed == [2]
    assert model.histograms[metrics.DRAFTS_PER_REQUEST.name].observed == [K, 2]
    model.finalize()
    assert (tmp_path / "snap.json").is_file()


def draft_args(tmp_path: Path, **extra: str) -> dict[str, str]:
    """Triton's initialize args of a draft model over a tiny random model."""
    _, draft_dir = save_tiny_pair(tmp_path / "pair")
    parameters = {"model_dir": str(draft_dir), "max_draft_tokens": str(K), "max_length": "64",
                  "max_sequences": "4", **extra}  # fmt: skip
    config = {
        "name": "draft",
        "input": [{"name": name} for name in STEP_INPUT_DTYPES],
        "parameters": {k: {"string_value": v} for k, v in parameters.items()},
    }
    return {"model_config": json.dumps(config), "model_repository": str(tmp_path / "r" / "d")}


def draft_request() -> dict[str, np.ndarray]:
    request = {name: np.zeros(1, dtype=dtype) for name, dtype in STEP_INPUT_DTYPES.items()}
    request["input_ids"] = np.full((1, 2), 65, dtype=np.int32)
    request.update(seq_ids=np.array([7]), input_lengths=np.array([2], dtype=np.int32),
                   num_draft_tokens=np.array([K], dtype=np.int32),
                   top_p=np.ones(1, dtype=np.float32),
                   prev_num_accepted=np.zeros(0, dtype=np.int32),
                   draft_plan=np.zeros(0, dtype=np.float32),
                   prev_timing_ms=np.zeros(0, dtype=np.float32),
                   prev_target_features=np.zeros((0, 0), dtype=np.float32),
                   prev_feature_counts=np.zeros(0, dtype=np.int32),
                   prev_feature_starts=np.zeros(0, dtype=np.int32))  # fmt: skip
    return request


@pytest.mark.parametrize("gpu_variant", [False, True], ids=["model.py", "model_gpu.py"])
def test_stage_model_picks_its_adapter_and_answers(tmp_path: Path, gpu_variant: bool) -> None:
    bases = (DeviceOutputs, StageModel) if gpu_variant else (StageModel,)
    model = type("Model", bases, {"STAGE": "draft", "pb": pb})()
    extra = {"FORCE_CPU_ONLY_INPUT_TENSORS": "no"} if gpu_variant else {}
    model.initialize(draft_args(tmp_path, **extra))
    (response,) = model.execute([draft_request()])
    outputs = {t.name: t.value for t in response.output_tensors}
    assert list(outputs) == [
        "draft_tokens", "draft_probs", "draft_features", "num_drafted", "draft_ms"
    ]  # fmt: skip
    assert all(isinstance(v, torch.Tensor if gpu_variant else np.ndarray) for v in outputs.values())
    assert tuple(outputs["draft_probs"].shape) == (1, K, 257)
    assert model.kv_live.value == 1
