"""Where a served decode step's time goes, from two scrapes of the server's metrics endpoint.

One step is one execution of the `speculative_step` ensemble (draft -> verifier -> target). Over
the interval between two scrapes, per step:

- step_ms: Triton's request duration of the ensemble (`nv_inference_request_duration_us`);
- draft_ms, verifier_ms, target_ms: each stage's compute time (`..._compute_infer_duration_us`);
- overhead_ms: step_ms - draft_ms - verifier_ms - target_ms, the hops between the stages
  (fixed per step whatever is drafted or verified);
- drafted, verified, stopped_early: the verifier's token counters; draft_passes: the mean of the
  `av_draft_passes` histogram; draft_ms_saved: the cost-table estimate of draft time saved
  against drafting every request to its cap.

The entry model's own share (scheduler, BLS call) is outside the ensemble and not counted.
Triton-free: it reads samples as `avspec.serving.stages.metrics.parse_metrics` returns them.
"""

from __future__ import annotations

import math

from avspec.serving.stages.metrics import Samples

_STAGES = ("draft", "verifier", "target")
_COUNTERS = {
    "drafted": "av_drafted_tokens_total",
    "verified": "av_verified_tokens_total",
    "stopped_early": "av_drafts_stopped_early_total",
    "draft_ms_saved": "av_draft_ms_saved_total",
    "draft_passes": "av_draft_passes_sum",
}


def step_breakdown(before: Samples, after: Samples, step_model: str = "speculative_step") -> dict:
    """Per-step means over the interval between two scrapes (NaN everywhere without a step)."""

    def delta(name: str, **labels: str) -> float:
        return _total(after, name, labels) - _total(before, name, labels)

    steps = delta("nv_inference_exec_count", model="verifier")
    out: dict[str, float] = {"steps": steps}
    per = (lambda v: v / steps) if steps > 0 else (lambda v: math.nan)
    out["step_ms"] = per(delta("nv_inference_request_duration_us", model=step_model) / 1e3)
    for stage in _STAGES:
        out[f"{stage}_ms"] = per(delta("nv_inference_compute_infer_duration_us", model=stage) / 1e3)
    out["overhead_ms"] = out["step_ms"] - sum(out[f"{s}_ms"] for s in _STAGES)
    for key, name in _COUNTERS.items():
        out[key] = per(delta(name))
    return out


def _total(samples: Samples, name: str, labels: dict[str, str]) -> float:
    """Sum of the samples of `name` whose labels include `labels` (0 when there is none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= set(ls))
