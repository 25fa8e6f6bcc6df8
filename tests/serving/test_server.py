"""End-to-end tests against the real Triton server (one per session, see conftest.py).

Tests run in file order and share the server; each makes its own traffic and compares metric
deltas, so none depends on another's leftovers except through monotone counters.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import tritonclient.http as httpclient
from helpers.clients import (
    GrpcStream,
    grpc_generate,
    http_generate,
    http_generate_stream,
    post_json,
    tritonclient_http_generate,
)
from helpers.server import ADMIN_KEY, K, all_freed, scrape, wait_for
from tritonclient.utils import InferenceServerException

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.serving.host.server_process import ServerProcess
from avspec.serving.stages.metrics import metric_value

PROMPTS = [f"prompt {i}: def f(x):" for i in range(16)]
GREEDY_TOKENS = 20


def bucket(samples: dict, le: str) -> float:
    return metric_value(samples, "av_step_batch_size_bucket", le=le)


def test_curl_style_generate(server: ServerProcess) -> None:
    out = http_generate(server.http_url, text_input="def ", max_tokens=16)
    assert len(out.text) == 16  # printable-ASCII pair: one character per token
    assert 0 <= out.accepted <= out.verified <= out.drafted


def test_curl_style_generate_stream(server: ServerProcess) -> None:
    events = http_generate_stream(
        server.http_url, text_input="def ", max_tokens=24, temperature=0.0
    )
    assert len(events) > 1, "a streamed request answers once per decode step"
    assert all("error" not in e for e in events), events
    text = "".join(e["text_output"] for e in events)
    once = http_generate(server.http_url, text_input="def ", max_tokens=24, temperature=0.0)
    assert text == once.text
    assert sum(e["drafted_tokens"] for e in events) > 0
    # output_ids: the token ids of each response, which decode to the response's text (Triton's
    # /generate JSON writes a one-element output as a bare number)
    per_event = [e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]]
                 for e in events]  # fmt: skip
    ids = [i for event_ids in per_event for i in event_ids]
    assert len(ids) == 24 and HFTokenizer.from_directory(server.target_dir).decode(ids) == text
    assert all(
        len(i) == e["accepted_tokens"] + 1 for i, e in zip(per_event[:-1], events[:-1], strict=True)
    )


def test_tritonclient_http(server: ServerProcess) -> None:
    """tritonclient.http: health, metadata and config work; /infer refuses decoupled models.

    Triton 2.51's HTTP /infer endpoint answers 501 for decoupled models, so HTTP generation goes
    through /generate and /generate_stream (docs/serving.md) and tritonclient users take gRPC.
    """
    with httpclient.InferenceServerClient(f"127.0.0.1:{server.http_port}") as client:
        assert client.is_server_ready()
        assert client.is_model_ready("speculative")
        for model in ("speculative_step", "draft", "verifier", "target"):
            assert not client.is_model_ready(model)  # internal: not even visible (403)
        inputs = {i["name"] for i in client.get_model_metadata("speculative")["inputs"]}
        assert {"text_input", "max_tokens", "stream", "adaptive_verification"} <= inputs
        config = client.get_model_config("speculative", headers={"avspec-admin-key": ADMIN_KEY})
        assert config["model_transaction_policy"]["decoupled"] is True
    with pytest.raises(InferenceServerException, match="decoupled"):
        tritonclient_http_generate(f"127.0.0.1:{server.http_port}", text_input="x", max_tokens=2)


@pytest.mark.parametrize("stream", [False, True])
def test_tritonclient_grpc(server: ServerProcess, stream: bool) -> None:
    out = grpc_generate(
        server.grpc_url, text_input="hello", max_tokens=24, temperature=0.0, stream=stream
    )
    reference = http_generate(server.http_url, text_input="hello", max_tokens=24, temperature=0.0)
    assert out.text == reference.text
    assert (out.responses > 1) if stream else (out.responses == 1)


def _greedy(server: ServerProcess, prompt: str, mode: str) -> str:
    extra = {
        "av_on": {"adaptive_verification": True, "adaptive_drafting": False},
        "av_drafting": {"adaptive_verification": True, "adaptive_drafting": True},
        "av_off": {"adaptive_verification": False},
        "no_drafts": {"num_draft_tokens": 0},
    }[mode]
    return http_generate(
        server.http_url, text_input=prompt, max_tokens=GREEDY_TOKENS, temperature=0.0, **extra
    ).text


@pytest.mark.parametrize("concurrency", [1, 16])
def test_greedy_identical_across_modes(server: ServerProcess, concurrency: int) -> None:
    """Temperature 0: AV on with and without adaptive drafting, AV off and no speculation give
    the same text, token for token; adaptive drafting did stop some drafts early."""
    prompts = PROMPTS[:4] if concurrency == 1 else PROMPTS
    texts = {}
    before = metric_value(scrape(server), "av_drafts_stopped_early_total")
    with ThreadPoolExecutor(concurrency) as pool:
        for mode in ("av_drafting", "av_on", "av_off", "no_drafts"):
            texts[mode] = list(pool.map(lambda p, m=mode: _greedy(server, p, m), prompts))
    assert metric_value(scrape(server), "av_drafts_stopped_early_total") > before
    assert texts["av_drafting"] == texts["no_drafts"]
    assert texts["av_on"] == texts["no_drafts"]
    assert texts["av_off"] == texts["no_drafts"]
    assert all(len(t) == GREEDY_TOKENS for t in texts["no_drafts"])


def test_batches_carry_all_concurrent_requests(server: ServerProcess) -> None:
    """16 concurrent requests are stepped together: steps with 9..16 sequences appear."""
    before = scrape(server)
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda p: _greedy(server, p, "av_on"), PROMPTS))
    after = scrape(server)

    def steps_of_9_to_16(samples: dict) -> float:
        return bucket(samples, "16") - bucket(samples, "8")

    grown = steps_of_9_to_16(after) - steps_of_9_to_16(before)
    assert grown >= 3, f"only {grown} steps carried 9..16 sequences"


def test_metrics_present_and_coefficients_move(server: ServerProcess) -> None:
    samples = scrape(server)
    names = {name for name, _ in samples}
    for name in (
        "av_estimator_slope", "av_estimator_intercept", "av_estimator_refits_total",
        "av_drafted_tokens_total", "av_verified_tokens_total", "av_accepted_tokens_total",
        "av_trimmed_tokens_total", "av_step_batch_size_bucket", "av_live_sequences",
        "av_kv_live_sequences", "av_budget_fraction", "av_calibration_mean_predicted",
        "av_calibration_observed_rate", "av_calibration_ece", "av_draft_passes_bucket",
        "av_drafts_per_request_bucket", "av_drafts_stopped_early_total",
        "av_draft_ms_saved_total", "av_cost_refreshes_total", "av_step_ms_predicted",
        "av_step_ms_observed",
    ):  # fmt: skip
        assert name in names, f"{name} missing from /metrics"
    for position in range(K):
        metric_value(samples, "av_estimator_intercept", position=str(position))
    for model in ("draft", "target"):
        metric_value(samples, "av_kv_live_sequences", model=model)
    # Sampled traffic until at least two refits since the session started.
    with ThreadPoolExecutor(8) as pool:
        list(
            pool.map(
                lambda i: http_generate(
                    server.http_url, text_input=PROMPTS[i], max_tokens=32, random_seed=i
                ),
                range(8),
            )
        )
    samples = scrape(server)
    assert metric_value(samples, "av_estimator_refits_total") >= 2
    assert metric_value(samples, "av_estimator_slope") != pytest.approx(0.5, abs=1e-4)
    assert metric_value(samples, "av_estimator_intercept", position="0") != pytest.approx(
        -0.2, abs=1e-4
    )
    drafted = metric_value(samples, "av_drafted_tokens_total")
    verified = metric_value(samples, "av_verified_tokens_total")
    trimmed = metric_value(samples, "av_trimmed_tokens_total")
    assert drafted == verified + trimmed
    assert 0 < metric_value(samples, "av_accepted_tokens_total") <= verified
    ece = metric_value(samples, "av_calibration_ece")
    assert 0 <= ece <= 1 and not math.isnan(ece)


def test_grpc_cancellation_frees_sequences(server: ServerProcess) -> None:
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(text_input="cancel me", max_tokens=200, stream=True)
        result, error = stream.next()
        assert error is None
        assert wait_for(lambda: metric_value(scrape(server), "av_live_sequences") >= 1, 10)
    finally:
        stream.close(cancel=True)
    assert wait_for(lambda: all_freed(server)), "cancelled sequence still holds state"
    # The server keeps serving.
    assert len(http_generate(server.http_url, text_input="after", max_tokens=4).text) == 4


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({"text_input": "", "max_tokens": 8}, "text_input"),
        ({"text_input": "x", "max_tokens": 0}, "max_tokens"),
        ({"text_input": "x", "max_tokens": 8, "num_draft_tokens": K + 1}, "num_draft_tokens"),
        ({"text_input": "x", "max_tokens": 8, "top_p": 2.0}, "top_p"),
        ({"text_input": "x", "max_tokens": 8, "temperature": -1.0}, "temperature"),
        ({"text_input": "x", "max_tokens": 8, "temperature": 1000.0}, "temperature"),
        ({"text_input": "x", "max_tokens": 100000}, "max_context"),
    ],
)
def test_bad_inputs_get_clear_errors(server: ServerProcess, payload: dict, problem: str) -> None:
    status, body = post_json(f"{server.http_url}/v2/models/speculative/generate", payload)
    assert status == 400, body
    assert problem in body


def test_bad_input_over_grpc_ends_the_stream(server: ServerProcess) -> None:
    stream = GrpcStream(server.grpc_url)
    try:
        stream.send(text_input="x", max_tokens=8, top_p=2.0, stream=True)
        result, error = stream.next(30)
        assert result is None and "top_p" in str(error)
    finally:
        stream.close()
    assert wait_for(lambda: all_freed(server))


def test_warm_start_restores_coefficients(server: ServerProcess) -> None:
    """Unload + load the verifier: the coefficients come back from the snapshot."""
    before = scrape(server)
    refits = metric_value(before, "av_estimator_refits_total")
    assert refits >= 1, "run after traffic that refitted the estimator"
    keys = [("av_estimator_slope", {})] + [
        ("av_estimator_intercept", {"position": str(k)}) for k in range(K)
    ]
    values = [metric_value(before, name, **labels) for name, labels in keys]
    server.repository_action("verifier", "unload")
    server.repository_action("verifier", "load")
    after = scrape(server)
    restored = [metric_value(after, name, **labels) for name, labels in keys]
    assert restored == pytest.approx(values, abs=1e-6)
    assert metric_value(after, "av_estimator_refits_total") == refits
    assert server.snapshot_path.is_file()
    # The step ensemble works with the reloaded verifier.
    assert len(http_generate(server.http_url, text_input="again", max_tokens=6).text) == 6


def _verifier_failures(samples: dict) -> float:
    return sum(
        value
        for (name, labels), value in samples.items()
        if name == "nv_inference_request_failure" and ("model", "verifier") in labels
    )


def test_hot_requests_stay_out_of_the_refit(server: ServerProcess) -> None:
    """temperature 3 > refit_max_temperature: rows reach the verifier as -1, no step fails.

    Adaptive drafting is off so every request drafts: at temperature 3 the plan may rightly
    draft nothing, and then no hot row would reach the verifier at all."""
    before = scrape(server)
    with ThreadPoolExecutor(4) as pool:
        outs = list(
            pool.map(
                lambda i: http_generate(
                    server.http_url,
                    text_input=PROMPTS[i],
                    max_tokens=16,
                    temperature=3.0,
                    random_seed=i,
                    adaptive_drafting=False,
                ),  # fmt: skip
                range(4),
            )
        )
    after = scrape(server)
    assert all(out.drafted > 0 for out in outs)
    assert _verifier_failures(after) == _verifier_failures(before)
    accepted = [metric_value(s, "av_accepted_tokens_total") for s in (before, after)]
    assert accepted[1] >= accepted[0]
