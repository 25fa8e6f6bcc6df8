"""Request parsing and response assembly of the entry model (no server)."""

from __future__ import annotations

import numpy as np
import pytest

from avspec.scheduler import StepReport
from avspec.serving.repository import EntryParams
from avspec.serving.requests import RequestError, ResponseStream, parse_generation_inputs
from avspec.tokenizer import ByteTokenizer

PARAMS = EntryParams(max_draft_tokens=8, adaptive_verification=True)
TOKENIZER = ByteTokenizer()


def inputs(**values: object) -> dict[str, np.ndarray]:
    base: dict[str, object] = {"text_input": b"hi", "max_tokens": 4}
    base.update(values)
    return {
        k: np.array([v], dtype=object if isinstance(v, bytes) else None) for k, v in base.items()
    }


def parse(**values: object):
    return parse_generation_inputs(inputs(**values), PARAMS, TOKENIZER)


def test_defaults() -> None:
    request, stream = parse()
    assert request.prompt_ids == [104, 105] and request.max_tokens == 4
    assert (request.temperature, request.top_p, request.random_seed) == (1.0, 1.0, 0)
    assert request.num_draft_tokens == 8 and request.adaptive is True and stream is False


def test_all_inputs() -> None:
    request, stream = parse(
        temperature=np.float32(0.0), top_p=np.float32(0.9), random_seed=np.uint64(2**64 - 1),
        stream=True, num_draft_tokens=np.int32(0), adaptive_verification=False,
    )  # fmt: skip
    assert request.temperature == 0.0 and request.top_p == pytest.approx(0.9)
    assert 0 <= request.random_seed < 2**63
    assert request.num_draft_tokens == 0 and request.adaptive is False and stream is True


def test_adaptive_default_from_parameters() -> None:
    request, _ = parse_generation_inputs(
        inputs(), EntryParams(adaptive_verification=False), TOKENIZER
    )
    assert request.adaptive is False


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"text_input": b""}, "text_input"),
        ({"text_input": b"\xff\xfe"}, "UTF-8"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"num_draft_tokens": 9}, "num_draft_tokens"),
        ({"num_draft_tokens": -1}, "num_draft_tokens"),
    ],
)
def test_invalid_inputs_name_the_problem(values: dict, problem: str) -> None:
    with pytest.raises(RequestError, match=problem):
        parse(**values)


def test_missing_required_inputs() -> None:
    with pytest.raises(RequestError, match="text_input is required"):
        parse_generation_inputs({"max_tokens": np.array([3])}, PARAMS, TOKENIZER)
    with pytest.raises(RequestError, match="max_tokens is required"):
        parse_generation_inputs({"text_input": np.array([b"x"], dtype=object)}, PARAMS, TOKENIZER)


def test_more_than_one_value() -> None:
    values = inputs()
    values["max_tokens"] = np.array([1, 2])
    with pytest.raises(RequestError, match="exactly one value"):
        parse_generation_inputs(values, PARAMS, TOKENIZER)


def report(tokens: list[int], drafted: int = 2, finished: bool = False) -> StepReport:
    return StepReport(tokens, drafted, 2, 1, finished, "length" if finished else None)


def test_stream_sends_each_step_with_complete_characters() -> None:
    stream = ResponseStream(stream=True)
    euro = list("€".encode())  # three bytes split across two steps
    first = stream.on_step(report([ord("a"), euro[0]]))
    second = stream.on_step(report(euro[1:], finished=True))
    assert (first.text, first.final, first.drafted) == ("a", False, 2)
    assert (second.text, second.final) == ("€", True)


def test_non_stream_sends_once_with_totals() -> None:
    stream = ResponseStream(stream=False)
    assert stream.on_step(report([ord("a")])) is None
    final = stream.on_step(report([ord("b"), 256], drafted=3, finished=True))
    assert (final.text, final.drafted, final.verified, final.accepted) == ("ab", 5, 4, 2)
    assert final.final and stream.finish_reason == "length"
