"""client/bench_openai.py and avspec.tools.bench.stream_metrics without a server: AIPerf's streaming
metrics from constructed chunk timestamps, and the chunks of the official client read back."""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from avspec.tools.bench.stream_metrics import (
    StreamRecord,
    combine_rounds,
    inter_chunk_gaps,
    inter_token_latency,
    request_latency,
    summarize,
    time_to_first_token,
)

bench = load_client_script("bench_openai")


def record(sent: float, times: list[float], tokens: list[int], **counts: int) -> StreamRecord:
    return StreamRecord(sent, times, tokens, output_tokens=sum(tokens), **counts)


def test_one_request_ttft_itl_icl():
    # 4 content chunks carrying 3, 1, 4 and 2 tokens (blocks of accepted drafts)
    r = record(10.0, [10.1, 10.13, 10.19, 10.22], [3, 1, 4, 2])
    assert time_to_first_token(r) == pytest.approx(0.1)
    assert request_latency(r) == pytest.approx(0.22)
    assert inter_token_latency(r) == pytest.approx(0.12 / 9)  # (last - first) / (10 - 1)
    assert inter_token_latency(r, first_chunk_tokens=True) == pytest.approx(0.12 / 7)
    assert inter_chunk_gaps(r) == pytest.approx([0.03, 0.06, 0.03])
    # mean ICL / ITL = (output tokens - 1) / (chunks - 1): tokens per gap, not 1
    mean_icl = sum(inter_chunk_gaps(r)) / 3
    assert mean_icl / inter_token_latency(r) == pytest.approx(9 / 3)


def test_undefined_cases():
    one_token = record(0.0, [0.5], [1])
    assert math.isnan(inter_token_latency(one_token)) and inter_chunk_gaps(one_token) == []
    whole_in_first_chunk = record(0.0, [0.5, 0.6], [4, 0])
    assert math.isnan(inter_token_latency(whole_in_first_chunk, first_chunk_tokens=True))
    assert inter_token_latency(whole_in_first_chunk) == pytest.approx(0.1 / 3)
    nothing = StreamRecord(0.0)
    assert math.isnan(time_to_first_token(nothing)) and math.isnan(inter_token_latency(nothing))


def test_summarize_phase():
    a = record(0.0, [0.2, 0.3, 0.4], [2, 2, 1], drafted=6, verified=4, accepted=2, steps=3)
    b = record(0.1, [0.4, 0.6], [1, 3], drafted=2, verified=2, accepted=2, steps=2)
    failed = StreamRecord(0.05, error="APIStatusError: 503")
    eos_first = StreamRecord(0.0)  # ended without a content chunk, no error
    s = summarize([a, b, failed, eos_first])
    assert (s["requests"], s["errors"], s["empty"]) == (2, 1, 1)
    assert s["duration_s"] == pytest.approx(0.6)  # last content chunk - first request sent
    assert s["output_tokens_per_s"] == pytest.approx(9 / 0.6)
    assert s["requests_per_s"] == pytest.approx(2 / 0.6)
    assert s["ttft_ms_median"] == pytest.approx(250.0)  # 200 and 300 ms
    itl_a, itl_b = 0.2 / 4, 0.2 / 3
    assert s["itl_ms_median"] == pytest.approx(1e3 * (itl_a + itl_b) / 2)
    assert s["icl_ms_median"] == pytest.approx(100.0)  # gaps 100, 100, 200 ms
    assert s["icl_ms_mean"] == pytest.approx(400 / 3)
    assert s["tokens_per_chunk"] == pytest.approx(9 / 5)
    assert s["tokens_per_s_per_user_max"] == pytest.approx(1 / itl_a)
    assert s["acceptance_rate"] == pytest.approx(4 / 6)
    assert s["accepted_per_drafted"] == pytest.approx(4 / 8)
    assert s["tokens_per_step"] == pytest.approx(9 / 5)
    assert summarize([failed, eos_first]) == {"requests": 0, "errors": 1, "empty": 1}


def test_combine_rounds():
    combined = combine_rounds([{"x": 1.0, "y": 5.0}, {"x": 3.0, "y": math.nan}, {"x": 2.0}])
    assert combined == {"x": {"median": 2.0, "min": 1.0, "max": 3.0}}


def step_figures(*tokens: tuple[str, bool]) -> dict:
    return {"tokens": [{"text": text, "draft": draft} for text, draft in tokens]}


def chat_chunk(delta: dict | None, speculative: dict | None = None, usage: dict | None = None):
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": None}]
    body = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
    extra = {"speculative": speculative} if speculative is not None else {}
    return ChatCompletionChunk.model_validate({**body, "choices": choices, "usage": usage, **extra})


async def aiter_of(items):
    for item in items:
        yield item


def consume(chunks: list, chat: bool) -> StreamRecord:
    clock = iter(float(t) for t in range(1, len(chunks) + 1))  # chunk i arrives at second i
    stream = aiter_of(chunks)
    return asyncio.run(bench.consume_stream(stream, StreamRecord(0.0), chat, lambda: next(clock)))


def test_consume_chat_stream():
    usage = {"prompt_tokens": 5, "completion_tokens": 5, "total_tokens": 10}
    totals = {"drafted_tokens": 7, "verified_tokens": 6, "accepted_tokens": 3, "steps": 3}
    r = consume(
        [
            chat_chunk({"role": "assistant", "content": ""}),  # 1: the role, no content
            chat_chunk({"content": "ab"}, step_figures(("a", True), ("b", False))),  # 2
            chat_chunk({"content": ""}, step_figures(("<", True), ("|", False))),  # 3: held back
            chat_chunk({"content": "<|c"}, step_figures(("c", False))),  # 4
            chat_chunk({}),  # 5: finish_reason only
            chat_chunk(None, totals, usage),  # 6: usage
        ],
        chat=True,
    )
    assert r.chunk_times == [2.0, 4.0] and r.chunk_tokens == [2, 3]
    assert r.output_tokens == 5 and (r.drafted, r.verified, r.accepted, r.steps) == (7, 6, 3, 3)


def test_consume_completion_stream():
    def chunk(text: str | None, speculative: dict | None = None, usage: dict | None = None):
        # the client does not validate stream chunks; validation wants a finish_reason
        choices = [] if text is None else [{"index": 0, "text": text, "finish_reason": "length"}]
        extra = {"speculative": speculative} if speculative is not None else {}
        return Completion.model_validate(
            {"id": "c", "object": "text_completion", "created": 0, "model": "m",
             "choices": choices, "usage": usage, **extra}
        )  # fmt: skip

    usage = {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}
    r = consume([chunk("x", step_figures(("x", False))), chunk(""), chunk(None, {}, usage)], False)
    assert r.chunk_times == [1.0] and r.chunk_tokens == [1] and r.output_tokens == 1


def test_load_prompts_interleaves(tmp_path: Path):
    for name in ("a", "b"):
        lines = [json.dumps({"prompt": f"{name}{i}"}) for i in range(4)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    assert bench.load_prompts(tmp_path, ["a", "b"], 2) == ["a0", "b0", "a2", "b2"]


def test_parse_args(tmp_path: Path):
    args = bench.parse_args(["--concurrency", "16,1,4,4", "--endpoint", "completions"])
    assert args.concurrency == [1, 4, 16] and args.out.name == "completions.json"
    for bad in (["--concurrency", "0"], ["--concurrency", "x"], ["--chat-template", "t.jinja"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_outputs_and_table(tmp_path: Path):
    args = bench.parse_args(["--out", str(tmp_path / "chat.json"), "--rounds", "2"])
    records = [record(0.0, [0.1, 0.2], [2, 2]), record(0.0, [0.1, 0.3], [1, 3])]
    phases = [
        {"round": r, "concurrency": 4, "summary": summarize(records[r : r + 1]),
         "records": [records[r].to_dict()]}
        for r in (0, 1)
    ]  # fmt: skip
    levels = bench.combined(phases)
    assert levels[4]["itl_ms_median"] == {"median": 50.0, "min": 100 / 3, "max": 200 / 3}
    bench.write_outputs(args, "http://x", 1.0, levels, phases)
    document = json.loads((tmp_path / "chat.json").read_text())
    assert "records" not in document["phases"][0] and document["combined"]["4"]["requests"]
    lines = (tmp_path / "chat_records.jsonl").read_text().splitlines()
    assert [json.loads(line)["chunk_ms"] for line in lines] == [[100.0, 200.0], [100.0, 300.0]]
    text = bench.table(levels, args.rounds).splitlines()
    assert len(text) == 3 and "33.33-66.67" in text[2]
