"""The Triton model classes behind the `model.py` adapters, with `pb_utils` passed in.

Only the `model.py` files under `model_repository*` import `triton_python_backend_utils`
(docs/architecture.md). Each subclasses a class here (or calls the helpers) and hands that module
over as `pb`, a class attribute: `class TritonPythonModel(StageModel): STAGE = "draft";
pb = pb_utils`. Attributes of `pb` are read at call time, never at import: Triton's
auto-complete pass imports model.py before the module is complete.

One class per served kind, CPU and GPU alike: requests are read as torch tensors (CPU memory
through numpy, device memory through DLPack) and handed to the stage's adapter
(avspec.serving.stages.adapters). The one difference of a GPU variant (configs/gpu.pbtxt, its
`model_gpu.py`) is how outputs leave: `DeviceOutputs` sends them through DLPack, on their device,
where a CPU model sends numpy copies.

Every `MetricFamily` is kept on the model instance: a family that is garbage-collected
invalidates its metrics (seen on Triton 2.51).
"""

from __future__ import annotations

import json
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, ClassVar

import numpy as np
import torch
from torch.utils.dlpack import from_dlpack, to_dlpack

from avspec.serving import repository
from avspec.serving.stages import metrics
from avspec.serving.stages.adapters import VerifierAdapter, VerifierStepStats, stage_adapter
from avspec.serving.stages.heap import HeapTrimmer, set_mmap_threshold

# Parameters read by the Python backend itself, not by our adapters' parameter parsers.
BACKEND_PARAMETERS = ("FORCE_CPU_ONLY_INPUT_TENSORS",)


def make_metric_family(pb: Any, spec: metrics.MetricSpec) -> Any:
    """A `pb.MetricFamily` for spec; the caller must keep it referenced."""
    kinds = {
        metrics.COUNTER: pb.MetricFamily.COUNTER,
        metrics.GAUGE: pb.MetricFamily.GAUGE,
        metrics.HISTOGRAM: pb.MetricFamily.HISTOGRAM,
    }
    return pb.MetricFamily(name=spec.name, description=spec.description, kind=kinds[spec.kind])


def input_names(config: Mapping[str, Any]) -> list[str]:
    """The input tensor names of a parsed model config, in config order."""
    return [tensor["name"] for tensor in config["input"]]


def adapter_parameters(config: Mapping[str, Any]) -> dict[str, Any]:
    """The `parameters` block of a parsed model config without BACKEND_PARAMETERS.

    The adapters parse their parameters strictly (unknown keys fail); the keys only the Python
    backend reads (a GPU variant's FORCE_CPU_ONLY_INPUT_TENSORS) are not theirs.
    """
    params = repository.model_parameters(config)
    return {key: value for key, value in params.items() if key not in BACKEND_PARAMETERS}


def tensor_from_pb(tensor: Any) -> torch.Tensor:
    """A torch view of a `pb.Tensor`: CPU memory through numpy, device memory through DLPack."""
    if tensor.is_cpu():
        return torch.from_numpy(np.ascontiguousarray(tensor.as_numpy()))
    return from_dlpack(tensor.to_dlpack())


def input_tensors(pb: Any, request: Any, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The request's named inputs as torch tensors, each left where it lives."""
    return {name: tensor_from_pb(pb.get_input_tensor_by_name(request, name)) for name in names}


def host_output_tensors(pb: Any, outputs: Mapping[str, torch.Tensor]) -> list[Any]:
    """`pb.Tensor`s of named torch outputs as numpy copies in host memory (CPU models)."""
    return [
        pb.Tensor(name, np.ascontiguousarray(value.detach().cpu().numpy()))
        for name, value in outputs.items()
    ]


def device_output_tensors(pb: Any, outputs: Mapping[str, torch.Tensor]) -> list[Any]:
    """`pb.Tensor`s of named torch outputs through DLPack, so they stay on their device."""
    return [
        pb.Tensor.from_dlpack(name, to_dlpack(value.contiguous()))
        for name, value in outputs.items()
    ]


def error_response(pb: Any, stage: str, err: Exception) -> Any:
    """The error response of one failed request, naming the stage and the exception type."""
    return pb.InferenceResponse(error=pb.TritonError(f"{stage}: {type(err).__name__}: {err}"))


def respond_each(
    pb: Any, requests: Sequence[Any], outputs: Callable[[Any], list[Any]], stage: str
) -> list[Any]:
    """One response per request: `outputs(request)`'s tensors, or that request's own error."""
    return [_respond(pb, request, outputs, stage) for request in requests]


def _respond(pb: Any, request: Any, outputs: Callable[[Any], list[Any]], stage: str) -> Any:
    try:
        return pb.InferenceResponse(output_tensors=outputs(request))
    except Exception as err:  # noqa: BLE001 - one request's failure is its own response
        return error_response(pb, stage, err)


async def respond_each_async(
    pb: Any,
    requests: Sequence[Any],
    outputs: Callable[[Any], Awaitable[list[Any]]],
    stage: str,
) -> list[Any]:
    """`respond_each` for an async `outputs`; requests are answered one after another."""
    return [await _respond_async(pb, request, outputs, stage) for request in requests]


async def _respond_async(
    pb: Any, request: Any, outputs: Callable[[Any], Awaitable[list[Any]]], stage: str
) -> Any:
    try:
        return pb.InferenceResponse(output_tensors=await outputs(request))
    except Exception as err:  # noqa: BLE001 - one request's failure is its own response
        return error_response(pb, stage, err)


def kv_live_gauge(pb: Any, stage: str) -> tuple[Any, Any]:
    """(family, metric) of the av_kv_live_sequences gauge of one stage, set to 0."""
    family = make_metric_family(pb, metrics.KV_LIVE_SEQUENCES)
    gauge = family.Metric(labels={"model": stage})
    gauge.set(0)
    return family, gauge


class AdapterModel:
    """What the stage and verifier models share: the adapter's tensors in and out; set pb.

    Outputs leave as numpy copies; a GPU variant adds `DeviceOutputs` to keep them on the device.
    """

    STAGE: ClassVar[str]
    pb: ClassVar[Any]

    def outputs(self, tensors: Mapping[str, torch.Tensor]) -> list[Any]:
        """The `pb.Tensor`s of an adapter's outputs."""
        return host_output_tensors(self.pb, tensors)

    def request_inputs(self, request: Any) -> dict[str, torch.Tensor]:
        """The request's inputs named in the model config, as torch tensors."""
        return input_tensors(self.pb, request, self.input_names)  # type: ignore[attr-defined]


class DeviceOutputs:
    """Mixin of the GPU variants (configs/gpu.pbtxt): outputs leave through DLPack, on device.

    So `draft_probs` [batch, K, vocab] never crosses to the host between models:
    `class TritonPythonModel(DeviceOutputs, StageModel)`.
    """

    pb: ClassVar[Any]

    def outputs(self, tensors: Mapping[str, torch.Tensor]) -> list[Any]:
        return device_output_tensors(self.pb, tensors)


class StageModel(AdapterModel):
    """The draft or target model (avspec.serving.stages.adapters.STAGE_ADAPTERS); set STAGE and
    pb."""

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        params = repository.parse_parameters(repository.StageParams, adapter_parameters(config))
        set_mmap_threshold(params.malloc_mmap_mib)
        root = repository.project_root(args["model_repository"])
        self.input_names = input_names(config)
        self.adapter = stage_adapter(self.STAGE, params, root)
        self.kv_family, self.kv_live = kv_live_gauge(self.pb, self.STAGE)
        self.heap = HeapTrimmer(params.malloc_trim_steps)

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        responses = respond_each(self.pb, requests, self.request_outputs, self.STAGE)
        self.kv_live.set(self.adapter.live_sequences)
        self.heap.step()
        return responses

    def request_outputs(self, request: Any) -> list[Any]:
        """The output tensors of one request (raises on a bad one)."""
        return self.outputs(self.adapter(self.request_inputs(request)))


class VerifierModel(AdapterModel):
    """The verifier model (avspec.serving.stages.adapters.VerifierAdapter) and its av_* metrics;
    set pb.

    The estimator is restored from snapshot_path on initialize (warm start) and saved at every
    refit and in finalize. Counters count this server's refits; a reloaded family keeps the
    server-side value.
    """

    STAGE: ClassVar[str] = "verifier"

    def initialize(self, args: Mapping[str, str]) -> None:
        config = json.loads(args["model_config"])
        estimator_config, params = repository.parse_verifier_parameters(adapter_parameters(config))
        root = repository.project_root(args["model_repository"])
        self.input_names = input_names(config)
        self.adapter = VerifierAdapter(estimator_config, params, root)
        self.families = {
            spec.name: make_metric_family(self.pb, spec) for spec in metrics.VERIFIER_METRICS
        }
        self.metrics = {
            spec.name: self.families[spec.name].Metric(labels={})
            for spec in metrics.VERIFIER_METRICS
            if not spec.labels and spec.kind != metrics.HISTOGRAM
        }
        self.intercepts = [
            self.families[metrics.ESTIMATOR_INTERCEPT.name].Metric(labels={"position": str(k)})
            for k in range(estimator_config.num_positions)
        ]
        self.histograms = {
            spec.name: self.families[spec.name].Metric(labels={}, buckets=list(spec.buckets))
            for spec in metrics.VERIFIER_METRICS
            if spec.kind == metrics.HISTOGRAM
        }
        self.refreshes = 0
        self.publish_estimator()

    def execute(self, requests: Sequence[Any]) -> list[Any]:
        return respond_each(self.pb, requests, self.request_outputs, self.STAGE)

    def finalize(self) -> None:
        self.adapter.save_snapshot()

    def request_outputs(self, request: Any) -> list[Any]:
        """The output tensors of one request (raises on a bad one); publishes its metrics."""
        outputs, stats = self.adapter(self.request_inputs(request))
        self.publish_step(stats)
        return self.outputs(outputs)

    def publish_step(self, stats: VerifierStepStats) -> None:
        """Push one step's counters, batch size, budget fraction (and a refit's estimator)."""
        counters = {
            metrics.DRAFTED_TOKENS.name: stats.drafted,
            metrics.VERIFIED_TOKENS.name: stats.verified,
            metrics.ACCEPTED_TOKENS.name: stats.accepted,
            metrics.TRIMMED_TOKENS.name: stats.trimmed,
            metrics.DRAFTS_STOPPED_EARLY.name: stats.stopped_early,
            metrics.DRAFT_MS_SAVED.name: stats.draft_ms_saved,
        }
        for name, value in counters.items():
            if value:
                self.metrics[name].increment(value)
        if stats.batch_size:
            self.histograms[metrics.STEP_BATCH_SIZE.name].observe(stats.batch_size)
            self.histograms[metrics.DRAFT_PASSES.name].observe(stats.draft_passes)
            for drafts in stats.drafts_per_request:
                self.histograms[metrics.DRAFTS_PER_REQUEST.name].observe(drafts)
        self.publish_costs()
        if stats.budget_fraction is not None:
            self.metrics[metrics.BUDGET_FRACTION.name].set(stats.budget_fraction)
        if stats.refitted:
            self.metrics[metrics.ESTIMATOR_REFITS.name].increment(1)
            self.publish_estimator()

    def publish_costs(self) -> None:
        """After a cost refresh: its count and the predicted / observed step ms."""
        refresh = self.adapter.refresh
        if refresh.updates == self.refreshes:
            return
        self.metrics[metrics.COST_REFRESHES.name].increment(refresh.updates - self.refreshes)
        self.refreshes = refresh.updates
        report = refresh.report()
        for spec, key in (
            (metrics.STEP_MS_PREDICTED, "predicted_step_ms"),
            (metrics.STEP_MS_OBSERVED, "observed_step_ms"),
        ):
            if report[key] is not None:
                self.metrics[spec.name].set(report[key])

    def publish_estimator(self) -> None:
        """Push the estimator's coefficients and window calibration (NaN ones are skipped)."""
        slope, intercepts = self.adapter.coefficients()
        self.metrics[metrics.ESTIMATOR_SLOPE.name].set(slope)
        for gauge, value in zip(self.intercepts, intercepts, strict=True):
            gauge.set(value)
        window = self.adapter.estimator.window_calibration()
        for spec, key in (
            (metrics.CALIBRATION_MEAN_PREDICTED, "mean_predicted"),
            (metrics.CALIBRATION_OBSERVED_RATE, "observed_rate"),
            (metrics.CALIBRATION_ECE, "ece"),
        ):
            if not math.isnan(window[key]):
                self.metrics[spec.name].set(window[key])
