"""Metric specs and the Prometheus text reader (no server)."""

from __future__ import annotations

import math

import pytest

from avspec.serving.stages.metrics import (
    ALL_METRICS,
    HISTOGRAM,
    STEP_BATCH_BUCKETS,
    metric_value,
    parse_metrics,
)

TEXT = """# HELP av_estimator_slope slope
# TYPE av_estimator_slope gauge
av_estimator_slope 0.53
av_estimator_intercept{position="0"} 0.4
av_estimator_intercept{position="1"} -0.1
av_step_batch_size_bucket{le="8"} 3
av_step_batch_size_bucket{le="+Inf"} 5
av_calibration_ece nan
nv_inference_count{model="draft",version="1"} 7
"""


def test_specs_are_unique_and_documented() -> None:
    names = [spec.name for spec in ALL_METRICS]
    assert len(names) == len(set(names))
    assert all(spec.name.startswith("av_") and spec.description for spec in ALL_METRICS)
    histograms = [spec for spec in ALL_METRICS if spec.kind == HISTOGRAM]
    assert [h.name for h in histograms] == [
        "av_step_batch_size", "av_draft_passes", "av_drafts_per_request"
    ]  # fmt: skip
    assert STEP_BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128)


def test_parse_metrics_and_lookup() -> None:
    samples = parse_metrics(TEXT)
    assert metric_value(samples, "av_estimator_slope") == 0.53
    assert metric_value(samples, "av_estimator_intercept", position="1") == -0.1
    assert metric_value(samples, "av_step_batch_size_bucket", le="+Inf") == 5
    assert metric_value(samples, "nv_inference_count", model="draft") == 7
    assert math.isnan(metric_value(samples, "av_calibration_ece"))


def test_lookup_missing_or_ambiguous() -> None:
    samples = parse_metrics(TEXT)
    with pytest.raises(KeyError, match="0 samples"):
        metric_value(samples, "av_nothing")
    with pytest.raises(KeyError, match="2 samples"):
        metric_value(samples, "av_estimator_intercept")
