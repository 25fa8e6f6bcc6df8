"""Triton-free request handling of the `speculative` entry model.

`parse_generation_inputs` turns one request's input tensors (numpy, ecosystem names:
text_input, max_tokens, temperature, top_p, random_seed, stream, num_draft_tokens,
adaptive_verification) into a `GenerationRequest`, raising `RequestError` that names the input.
`ResponseStream` turns the scheduler's per-step reports into what one client receives: a chunk
per step when streaming (newly completed text and that step's counts), one final chunk with the
whole text and the totals otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from avspec.scheduler import GenerationRequest, StepReport
from avspec.serving.repository import EntryParams
from avspec.tokenizer import ByteTokenizer, IncrementalDecoder

_SEED_RANGE = 1 << 63  # seeds travel as int64


class RequestError(ValueError):
    """A request input is missing or invalid; the message names the input."""


def _scalar(values: Mapping[str, np.ndarray | None], name: str) -> object | None:
    """The single element of input `name`, or None if the input is absent."""
    array = values.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {array.shape}")
    return array.reshape(-1)[0]


def parse_generation_inputs(
    values: Mapping[str, np.ndarray | None],
    params: EntryParams,
    tokenizer: ByteTokenizer,
) -> tuple[GenerationRequest, bool]:
    """Return (request, stream) from one request's inputs; RequestError naming the problem."""
    text = _scalar(values, "text_input")
    if text is None:
        raise RequestError("text_input is required")
    if isinstance(text, bytes | np.bytes_):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError("text_input is not valid UTF-8") from None
    if not isinstance(text, str) or not text:
        raise RequestError("text_input must be a non-empty string")
    max_tokens = _scalar(values, "max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required")
    if int(max_tokens) < 1:
        raise RequestError(f"max_tokens must be >= 1, got {int(max_tokens)}")
    temperature = _float(values, "temperature", 1.0)
    if not temperature >= 0:
        raise RequestError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    top_p = _float(values, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must lie in (0, 1], got {top_p}")
    k = params.max_draft_tokens
    num_draft = _scalar(values, "num_draft_tokens")
    num_draft = k if num_draft is None else int(num_draft)
    if not 0 <= num_draft <= k:
        raise RequestError(f"num_draft_tokens must lie in 0..{k}, got {num_draft}")
    seed = _scalar(values, "random_seed")
    adaptive = _scalar(values, "adaptive_verification")
    stream = _scalar(values, "stream")
    request = GenerationRequest(
        prompt_ids=tokenizer.encode(text),
        max_tokens=int(max_tokens),
        temperature=temperature,
        top_p=top_p,
        random_seed=0 if seed is None else int(seed) % _SEED_RANGE,
        num_draft_tokens=num_draft,
        adaptive=params.adaptive_verification if adaptive is None else bool(adaptive),
    )
    return request, bool(stream) if stream is not None else False


def _float(values: Mapping[str, np.ndarray | None], name: str, default: float) -> float:
    value = _scalar(values, name)
    value = default if value is None else float(value)
    if math.isnan(value):
        raise RequestError(f"{name} must not be NaN")
    return value


@dataclass
class ResponseChunk:
    """One response to send: text and token counts; `final` ends the request."""

    text: str
    drafted: int
    verified: int
    accepted: int
    final: bool


class ResponseStream:
    """Per-request response assembly from scheduler reports (see the module docstring)."""

    def __init__(self, stream: bool, tokenizer: ByteTokenizer | None = None) -> None:
        self.stream = stream
        self.decoder = IncrementalDecoder(tokenizer)
        self.parts: list[str] = []
        self.drafted = self.verified = self.accepted = 0
        self.finish_reason: str | None = None

    def on_step(self, report: StepReport) -> ResponseChunk | None:
        """Fold in one step; return the chunk to send now (None: nothing to send yet)."""
        text = self.decoder.push(report.new_tokens)
        if report.finished:
            text += self.decoder.flush()
            self.finish_reason = report.finish_reason
        self.parts.append(text)
        self.drafted += report.drafted
        self.verified += report.verified
        self.accepted += report.accepted
        if self.stream:
            return ResponseChunk(
                text, report.drafted, report.verified, report.accepted, report.finished
            )
        if report.finished:
            return ResponseChunk(
                "".join(self.parts), self.drafted, self.verified, self.accepted, True
            )
        return None
