"""Triton adapter of the adaptive verifier: features in, num_verify out, av_* metrics exported.

The estimator lives in this instance; it is restored from snapshot_path on initialize (warm
start) and saved at every refit and in finalize (avspec.serving.adapters.VerifierAdapter).
"""

import json
import math

import triton_python_backend_utils as pb_utils

from avspec.serving import metrics, repository
from avspec.serving.adapters import VerifierAdapter


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        estimator_config, params = repository.parse_verifier_parameters(
            repository.model_parameters(config)
        )
        root = repository.project_root(args["model_repository"])
        self.input_names = [tensor["name"] for tensor in config["input"]]
        self.adapter = VerifierAdapter(estimator_config, params, root)
        kinds = {
            metrics.COUNTER: pb_utils.MetricFamily.COUNTER,
            metrics.GAUGE: pb_utils.MetricFamily.GAUGE,
            metrics.HISTOGRAM: pb_utils.MetricFamily.HISTOGRAM,
        }
        # Families must stay referenced, or their metrics die with them (triton.md pitfall).
        self.families = {
            spec.name: pb_utils.MetricFamily(
                name=spec.name, description=spec.description, kind=kinds[spec.kind]
            )
            for spec in metrics.VERIFIER_METRICS
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
        self.batch_sizes = self.families[metrics.STEP_BATCH_SIZE.name].Metric(
            labels={}, buckets=list(metrics.STEP_BATCH_BUCKETS)
        )
        # Counters count this server's refits; a reloaded family keeps the server-side value.
        self._publish_estimator()

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                arrays = {
                    name: pb_utils.get_input_tensor_by_name(request, name).as_numpy()
                    for name in self.input_names
                }
                outputs, stats = self.adapter(arrays)
                self._publish_step(stats)
                tensors = [pb_utils.Tensor(name, value) for name, value in outputs.items()]
                responses.append(pb_utils.InferenceResponse(output_tensors=tensors))
            except Exception as err:  # noqa: BLE001 - one request's failure is its own response
                message = f"verifier: {type(err).__name__}: {err}"
                responses.append(pb_utils.InferenceResponse(error=pb_utils.TritonError(message)))
        return responses

    def finalize(self):
        self.adapter.save_snapshot()

    def _publish_step(self, stats):
        counters = {
            metrics.DRAFTED_TOKENS.name: stats.drafted,
            metrics.VERIFIED_TOKENS.name: stats.verified,
            metrics.ACCEPTED_TOKENS.name: stats.accepted,
            metrics.TRIMMED_TOKENS.name: stats.trimmed,
        }
        for name, value in counters.items():
            if value:
                self.metrics[name].increment(value)
        if stats.batch_size:
            self.batch_sizes.observe(stats.batch_size)
        if stats.budget_fraction is not None:
            self.metrics[metrics.BUDGET_FRACTION.name].set(stats.budget_fraction)
        if stats.refitted:
            self.metrics[metrics.ESTIMATOR_REFITS.name].increment(1)
            self._publish_estimator()

    def _publish_estimator(self):
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
