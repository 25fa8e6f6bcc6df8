"""Step breakdown from two constructed scrapes with a known answer."""

from __future__ import annotations

import math

import pytest

from avspec.serving.stages.metrics import parse_metrics
from avspec.tools.bench.step_breakdown import step_breakdown


def scrape(
    steps: int, step_us: float, draft_us: float, verifier_us: float, target_us: float,
    drafted: int, verified: int, stopped: int, saved: float, passes: int,
) -> dict:  # fmt: skip
    text = f"""
nv_inference_exec_count{{model="verifier",version="1"}} {steps}
nv_inference_exec_count{{model="draft",version="1"}} {steps}
nv_inference_request_duration_us{{model="speculative_step",version="1"}} {step_us}
nv_inference_request_duration_us{{model="speculative",version="1"}} 999999
nv_inference_compute_infer_duration_us{{model="draft",version="1"}} {draft_us}
nv_inference_compute_infer_duration_us{{model="verifier",version="1"}} {verifier_us}
nv_inference_compute_infer_duration_us{{model="target",version="1"}} {target_us}
av_drafted_tokens_total {drafted}
av_verified_tokens_total {verified}
av_drafts_stopped_early_total {stopped}
av_draft_ms_saved_total {saved}
av_draft_passes_sum {passes}
"""
    return parse_metrics(text)


def test_per_step_means_and_the_overhead() -> None:
    before = scrape(10, 1e6, 2e5, 5e4, 6e5, 100, 80, 5, 3.0, 40)
    # 4 more steps: 400 ms in the ensemble, 80 ms draft, 20 ms verifier, 260 ms target.
    after = scrape(14, 1.4e6, 2.8e5, 7e4, 8.6e5, 140, 100, 25, 11.0, 52)
    b = step_breakdown(before, after)
    assert b["steps"] == 4
    assert b["step_ms"] == pytest.approx(100.0)
    assert (b["draft_ms"], b["verifier_ms"], b["target_ms"]) == pytest.approx((20.0, 5.0, 65.0))
    assert b["overhead_ms"] == pytest.approx(10.0)
    assert (b["drafted"], b["verified"], b["stopped_early"]) == pytest.approx((10.0, 5.0, 5.0))
    assert (b["draft_ms_saved"], b["draft_passes"]) == pytest.approx((2.0, 3.0))


def test_no_step_gives_nan() -> None:
    same = scrape(3, 1.0, 1.0, 1.0, 1.0, 1, 1, 0, 0.0, 1)
    b = step_breakdown(same, same)
    assert b["steps"] == 0 and math.isnan(b["step_ms"]) and math.isnan(b["drafted"])
