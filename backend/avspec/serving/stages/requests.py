"""Triton-free request handling of the `speculative` entry model.

`parse_prompt_request` checks one request's input tensors (numpy, ecosystem names: text_input,
max_tokens, temperature, top_p, random_seed, stream, num_draft_tokens, adaptive_verification,
adaptive_drafting, ignore_eos) without tokenizing, raising `RequestError` that names the input:
a prompt whose bytes cannot fit the context (`avspec.serving.stages.prompt_bound`) is refused
before any tokenizer sees it. `PromptRequest.tokenize` then makes the `GenerationRequest` from
the prompt's token ids, special-token text inside the `plain_spans` of text_input encoded as text
(the entry tokenizes off the serving path, avspec.serving.stages.entry);
`parse_generation_inputs` does both in one call.
Integer inputs are range-checked as received, before any int32 cast, so a wide value is refused
rather than wrapped. `parse_client` reads the client identity from the request parameters.
`ResponseStream` turns the scheduler's per-step reports into what one client receives: a chunk
per step when streaming (newly completed text and that step's counts), one final chunk with the
whole text and the totals otherwise. Both take a `Tokenizer`; `entry_tokenizer` picks the one the
entry model serves with: the target model's (its Hugging Face `tokenizer.json`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from avspec.engine.scheduler import MAX_TEMPERATURE
from avspec.engine.sequence import GenerationRequest, StepReport
from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.tokenizer import Tokenizer
from avspec.serving.repository import EntryParams, target_model_dir
from avspec.serving.stages.prompt_bound import PromptBound

_SEED_RANGE = 1 << 63  # seeds travel as int64
_INT32_MAX = (1 << 31) - 1
CLIENT_PARAMETER = "avspec-client"  # request parameter (a header forwarded by Triton)
MAX_CLIENT_LENGTH = 256


class RequestError(ValueError):
    """A request input is missing or invalid; the message names the input."""


def entry_tokenizer(model_directory: str | Path) -> Tokenizer:
    """The tokenizer of the entry model whose directory is `model_directory` (Triton's
    `args["model_repository"]`): `load_tokenizer` of `target_model_dir`. Raises ValueError
    naming what is missing: the target config, its `model_dir`, or a Hugging Face checkpoint
    with a `tokenizer.json` there."""
    return load_tokenizer(target_model_dir(model_directory))


def _scalar(values: Mapping[str, np.ndarray | None], name: str) -> object | None:
    """The single element of input `name`, or None if the input is absent."""
    array = values.get(name)
    if array is None:
        return None
    array = np.asarray(array)
    if array.size != 1:
        raise RequestError(f"{name} must hold exactly one value, got shape {array.shape}")
    return array.reshape(-1)[0]


def _integer(values: Mapping[str, np.ndarray | None], name: str) -> int | None:
    """Input `name` as an exact Python int (no cast to a narrower type), or None if absent."""
    value = _scalar(values, name)
    if value is None:
        return None
    if isinstance(value, bool | np.bool_) or not isinstance(value, int | np.integer):
        raise RequestError(f"{name} must be an integer, got {value!r}")
    return int(value)


def parse_client(parameters: str | None) -> str:
    """The client identity in a request's parameters JSON (`request.parameters()`); "" if absent.

    The front proxy sets `avspec-client` as a header Triton forwards as a request parameter
    (`--http-header-forward-pattern` / `--grpc-header-forward-pattern`) or as a generate-body
    key; header names are case-insensitive, so the key is matched without case.
    """
    if not parameters:
        return ""
    try:
        decoded = json.loads(parameters)
    except json.JSONDecodeError:
        raise RequestError("request parameters are not valid JSON") from None
    if not isinstance(decoded, dict):
        raise RequestError("request parameters must be a JSON object")
    for key, value in decoded.items():
        if key.lower() == CLIENT_PARAMETER:
            if not isinstance(value, str) or len(value) > MAX_CLIENT_LENGTH:
                raise RequestError(
                    f"{CLIENT_PARAMETER} must be a string of at most {MAX_CLIENT_LENGTH} "
                    "characters"
                )
            return value
    return ""


@dataclass(frozen=True)
class PromptRequest:
    """A request's checked inputs before tokenization: its text, whether it streams, and its
    generation settings (`settings.prompt_ids` is empty until `generation`)."""

    text: str
    stream: bool
    settings: GenerationRequest
    # (start, end) character spans of `text` encoded as plain text (`plain_spans`)
    plain: tuple[tuple[int, int], ...] = ()

    def generation(self, prompt_ids: Sequence[int]) -> GenerationRequest:
        """The request to submit, with the text's token ids as its prompt."""
        return dataclasses.replace(self.settings, prompt_ids=list(prompt_ids))

    def tokenize(self, tokenizer: Tokenizer) -> GenerationRequest:
        """`generation` of the text's token ids, its plain spans encoded as text."""
        return self.generation(tokenizer.encode(self.text, self.plain))


def parse_prompt_request(
    values: Mapping[str, np.ndarray | None],
    params: EntryParams,
    client: str = "",
    bound: PromptBound | None = None,
) -> PromptRequest:
    """Check one request's inputs without tokenizing; RequestError naming the problem.

    `client` is the identity from `parse_client`; `bound` the tokenizer's prompt bound (the most
    counted bytes one token can consume and the bytes it drops uncounted,
    `avspec.serving.stages.prompt_bound.prompt_bound_of`; None: no byte bound). Refused before
    tokenizing: a `max_tokens` that leaves no room for a prompt in `max_context`, and a
    `text_input` with more counted bytes than the room's tokens times `bound.token_bytes`.
    """
    text = _scalar(values, "text_input")
    if text is None:
        raise RequestError("text_input is required")
    max_tokens = _integer(values, "max_tokens")
    if max_tokens is None:
        raise RequestError("max_tokens is required")
    if not 1 <= max_tokens <= _INT32_MAX:
        raise RequestError(f"max_tokens must lie in 1..{_INT32_MAX}, got {max_tokens}")
    k = params.max_draft_tokens
    room = params.max_context - max_tokens - k  # prompt tokens that fit
    if room < 1:
        raise RequestError(
            f"max_tokens {max_tokens} + {k} draft tokens leave no room for a prompt in "
            f"max_context {params.max_context}"
        )
    if isinstance(text, str):
        text = text.encode("utf-8", errors="surrogatepass")
    if not isinstance(text, bytes | np.bytes_):
        raise RequestError("text_input must be a non-empty string")
    if bound is not None and len(text) > (limit := bound.byte_limit(room)):
        counted = bound.counted_bytes(text)  # only past the limit: one pass, C speed
        if counted > limit:
            unit = "counted bytes" if bound.dropped else "bytes"
            size = f"{len(text)} bytes"
            if counted < len(text):
                size += (
                    f" ({counted} counted: the tokenizer drops the other "
                    f"{len(text) - counted} without a token)"
                )
            raise RequestError(
                f"text_input is {size}; at most {limit} {unit} can fit the {room} prompt tokens "
                f"left by max_context {params.max_context}, max_tokens {max_tokens} and {k} "
                f"draft tokens (a token spans at most {bound.token_bytes} {unit})"
            )
    raw = bytes(text)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError("text_input is not valid UTF-8") from None
    if not text:
        raise RequestError("text_input must be a non-empty string")
    plain = _plain_spans(values.get("plain_spans"), raw)
    temperature = _float(values, "temperature", 1.0)
    if not 0 <= temperature <= MAX_TEMPERATURE:
        raise RequestError(
            f"temperature must lie in 0..{MAX_TEMPERATURE:g} (0 = greedy), got {temperature}"
        )
    top_p = _float(values, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must lie in (0, 1], got {top_p}")
    num_draft = _integer(values, "num_draft_tokens")
    num_draft = k if num_draft is None else num_draft
    if not 0 <= num_draft <= k:
        raise RequestError(f"num_draft_tokens must lie in 0..{k}, got {num_draft}")
    seed = _integer(values, "random_seed")
    adaptive = _scalar(values, "adaptive_verification")
    drafting = _scalar(values, "adaptive_drafting")
    ignore_eos = _scalar(values, "ignore_eos")
    stream = _scalar(values, "stream")
    settings = GenerationRequest(
        prompt_ids=[],
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        random_seed=0 if seed is None else seed % _SEED_RANGE,
        num_draft_tokens=num_draft,
        adaptive=params.adaptive_verification if adaptive is None else bool(adaptive),
        adaptive_drafting=params.adaptive_drafting if drafting is None else bool(drafting),
        client=client,
        ignore_eos=bool(ignore_eos) if ignore_eos is not None else False,
    )
    return PromptRequest(text, bool(stream) if stream is not None else False, settings, plain)


def _plain_spans(spans: np.ndarray | None, raw: bytes) -> tuple[tuple[int, int], ...]:
    """`plain_spans` (flat [start, end, ...] UTF-8 byte offsets of text_input, ascending and
    disjoint, on character boundaries) as character spans; RequestError naming the problem."""
    if spans is None:
        return ()
    flat = np.asarray(spans).reshape(-1)
    if flat.size % 2 or (flat.size and not np.issubdtype(flat.dtype, np.integer)):
        raise RequestError("plain_spans must hold pairs of integers [start, end, start, end, ...]")
    edges = [int(v) for v in flat]
    if any(b < a for a, b in zip([0, *edges], edges, strict=False)) or (
        edges and edges[-1] > len(raw)
    ):
        raise RequestError(
            f"plain_spans must be ascending, disjoint byte offsets within text_input's "
            f"{len(raw)} bytes"
        )
    chars, done, count = [], 0, 0  # one pass over the text, however many edges
    for edge in edges:
        try:
            count += len(raw[done:edge].decode("utf-8"))
        except UnicodeDecodeError:
            raise RequestError(f"plain_spans offset {edge} splits a UTF-8 character") from None
        chars.append(count)
        done = edge
    return tuple((a, b) for a, b in zip(chars[::2], chars[1::2], strict=True) if b > a)


def parse_generation_inputs(
    values: Mapping[str, np.ndarray | None],
    params: EntryParams,
    tokenizer: Tokenizer,
    client: str = "",
    bound: PromptBound | None = None,
) -> tuple[GenerationRequest, bool]:
    """Return (request, stream) from one request's inputs: `parse_prompt_request`, then the
    text tokenized here (RequestError naming the problem)."""
    prompt = parse_prompt_request(values, params, client, bound)
    return prompt.tokenize(tokenizer), prompt.stream


def _float(values: Mapping[str, np.ndarray | None], name: str, default: float) -> float:
    value = _scalar(values, name)
    value = default if value is None else float(value)  # type: ignore[arg-type]
    if math.isnan(value):
        raise RequestError(f"{name} must not be NaN")
    return value


@dataclass
class ResponseChunk:
    """One response to send: text, the token ids it carries (`output_ids`) and the draft
    counts; `final` ends the request."""

    text: str
    drafted: int
    verified: int
    accepted: int
    final: bool
    output_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0  # the prompt's token count, as tokenized for the request


class ResponseStream:
    """Per-request response assembly from scheduler reports (see the module docstring)."""

    def __init__(self, stream: bool, tokenizer: Tokenizer) -> None:
        self.stream = stream
        self.decoder = tokenizer.incremental_decoder()
        self.parts: list[str] = []
        self.ids: list[int] = []
        self.drafted = self.verified = self.accepted = 0
        self.finish_reason: str | None = None
        self.prompt_tokens = 0  # set once the prompt is tokenized (RequestSink.tokenized)

    def on_step(self, report: StepReport) -> ResponseChunk | None:
        """Fold in one step; return the chunk to send now (None: nothing to send yet)."""
        text = self.decoder.push(report.new_tokens)
        if report.finished:
            text += self.decoder.flush()
            self.finish_reason = report.finish_reason
        self.parts.append(text)
        self.ids.extend(report.new_tokens)
        self.drafted += report.drafted
        self.verified += report.verified
        self.accepted += report.accepted
        if self.stream:
            return ResponseChunk(
                text, report.drafted, report.verified, report.accepted, report.finished,
                tuple(report.new_tokens), self.prompt_tokens,
            )  # fmt: skip
        if report.finished:
            return ResponseChunk(
                "".join(self.parts), self.drafted, self.verified, self.accepted, True,
                tuple(self.ids), self.prompt_tokens,
            )  # fmt: skip
        return None
