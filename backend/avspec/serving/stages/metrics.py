"""The custom metrics of the deployment: names, kinds, descriptions, labels; and a reader.

The `model.py` adapters create one `pb_utils.MetricFamily` per `MetricSpec` below (kept on the
model instance: a family that is garbage-collected invalidates its metrics) and the values
appear on the server's metrics port next to Triton's own `nv_*` metrics. docs/serving.md lists
the same table for operators.

`parse_metrics` reads the Prometheus text format back (tests, benchmarks); it needs no Triton.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
STEP_BATCH_BUCKETS = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
DRAFT_BUCKETS = (0.0, 1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0)


@dataclass(frozen=True)
class MetricSpec:
    """One metric family: Prometheus name, kind, help text, label names, histogram buckets."""

    name: str
    kind: str
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


# Exported by the verifier model (one estimator per verifier instance).
ESTIMATOR_SLOPE = MetricSpec(
    "av_estimator_slope", GAUGE, "Acceptance estimator slope w shared by all draft positions"
)
ESTIMATOR_INTERCEPT = MetricSpec(
    "av_estimator_intercept",
    GAUGE,
    "Acceptance estimator intercept b_k of draft position k",
    labels=("position",),
)
ESTIMATOR_REFITS = MetricSpec(
    "av_estimator_refits_total", COUNTER, "Newton refits of the acceptance estimator"
)
DRAFTED_TOKENS = MetricSpec(
    "av_drafted_tokens_total", COUNTER, "Draft tokens proposed (candidates for verification)"
)
VERIFIED_TOKENS = MetricSpec(
    "av_verified_tokens_total", COUNTER, "Draft tokens admitted to target verification"
)
ACCEPTED_TOKENS = MetricSpec(
    "av_accepted_tokens_total", COUNTER, "Verified draft tokens the target accepted"
)
TRIMMED_TOKENS = MetricSpec(
    "av_trimmed_tokens_total", COUNTER, "Draft tokens trimmed by adaptive verification"
)
STEP_BATCH_SIZE = MetricSpec(
    "av_step_batch_size",
    HISTOGRAM,
    "Sequences per verifier step (one speculative decode step of the whole batch)",
    buckets=STEP_BATCH_BUCKETS,
)
BUDGET_FRACTION = MetricSpec(
    "av_budget_fraction", GAUGE, "Last step's verification budget / candidate draft tokens"
)
CALIBRATION_MEAN_PREDICTED = MetricSpec(
    "av_calibration_mean_predicted",
    GAUGE,
    "Mean predicted acceptance over the labelled drafts of the last refit window",
)
CALIBRATION_OBSERVED_RATE = MetricSpec(
    "av_calibration_observed_rate",
    GAUGE,
    "Observed acceptance rate over the labelled drafts of the last refit window",
)
CALIBRATION_ECE = MetricSpec(
    "av_calibration_ece",
    GAUGE,
    "Expected calibration error (10 equal-width bins) over the last refit window",
)
DRAFT_PASSES = MetricSpec(
    "av_draft_passes",
    HISTOGRAM,
    "Draft positions drafted by the deepest row per step (draft passes run)",
    buckets=DRAFT_BUCKETS,
)
DRAFTS_PER_REQUEST = MetricSpec(
    "av_drafts_per_request",
    HISTOGRAM,
    "Drafts each request drafted per step (num_drafted; at most its num_draft_tokens)",
    buckets=DRAFT_BUCKETS,
)
DRAFTS_STOPPED_EARLY = MetricSpec(
    "av_drafts_stopped_early_total",
    COUNTER,
    "Draft tokens not drafted because the plan stopped a request below its num_draft_tokens",
)
DRAFT_MS_SAVED = MetricSpec(
    "av_draft_ms_saved_total",
    COUNTER,
    "Draft milliseconds saved against drafting every request to its cap (cost-table estimate)",
)
COST_REFRESHES = MetricSpec(
    "av_cost_refreshes_total", COUNTER, "Online refreshes of the cost tables from stage times"
)
STEP_MS_PREDICTED = MetricSpec(
    "av_step_ms_predicted",
    GAUGE,
    "Median step ms the cost tables in force predict over the refresh window",
)
STEP_MS_OBSERVED = MetricSpec(
    "av_step_ms_observed", GAUGE, "Median step ms the scheduler measured over the refresh window"
)
VERIFIER_METRICS = (
    ESTIMATOR_SLOPE,
    ESTIMATOR_INTERCEPT,
    ESTIMATOR_REFITS,
    DRAFTED_TOKENS,
    VERIFIED_TOKENS,
    ACCEPTED_TOKENS,
    TRIMMED_TOKENS,
    STEP_BATCH_SIZE,
    BUDGET_FRACTION,
    CALIBRATION_MEAN_PREDICTED,
    CALIBRATION_OBSERVED_RATE,
    CALIBRATION_ECE,
    DRAFT_PASSES,
    DRAFTS_PER_REQUEST,
    DRAFTS_STOPPED_EARLY,
    DRAFT_MS_SAVED,
    COST_REFRESHES,
    STEP_MS_PREDICTED,
    STEP_MS_OBSERVED,
)

# Exported by the entry model (its scheduler holds the live sequences).
LIVE_SEQUENCES = MetricSpec(
    "av_live_sequences", GAUGE, "Sequences admitted to the entry model's scheduler, not finished"
)
# Exported by the draft and target models, label model="draft" | "target".
KV_LIVE_SEQUENCES = MetricSpec(
    "av_kv_live_sequences",
    GAUGE,
    "Sequences holding a KV cache slot in the draft or target model",
    labels=("model",),
)

ALL_METRICS = (*VERIFIER_METRICS, LIVE_SEQUENCES, KV_LIVE_SEQUENCES)

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# Parsed samples: (metric name, its labels) -> value.
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_metrics(text: str) -> Samples:
    """Parse Prometheus text exposition into {(sample name, labels): value}, names as exposed.

    Histograms appear as their `_bucket` (label `le`), `_sum` and `_count` samples. Not
    prometheus_client's parser: it renames every counter sample to its OpenMetrics `_total` form
    (Triton's `nv_inference_request_success` becomes `nv_inference_request_success_total`), and
    the benchmarks, the profiler and the Grafana dashboard all use the names Triton exposes.
    """
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        label_set = frozenset(_LABEL.findall(labels or ""))
        samples[(name, label_set)] = _to_float(value)
    return samples


def metric_value(samples: Samples, name: str, **labels: str) -> float:
    """Return the sample `name` whose labels include `labels` (KeyError if none, or ambiguous)."""
    want = set(labels.items())
    found = [v for (n, ls), v in samples.items() if n == name and want <= set(ls)]
    if len(found) != 1:
        raise KeyError(f"{len(found)} samples of {name} with labels {labels}")
    return found[0]


def _to_float(text: str) -> float:
    lowered = text.lower()
    if lowered in ("nan", "+inf", "inf", "-inf"):
        return {"nan": math.nan, "-inf": -math.inf}.get(lowered, math.inf)
    return float(text)
