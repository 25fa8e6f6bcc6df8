"""One OpenAI request as a call of the entry's `generate_stream`, its text rebuilt token by token.

The front sends the entry's own inputs (`text_input`, `max_tokens`, `temperature`, `top_p`,
`random_seed`, `stream` true, the speculative settings) with the caller's identity
(`avspec-client`, as on /v2), so the same admission, fairness and refit-share rules apply. Each
server-sent event of Triton's answer is one decode step: its `output_ids` (the accepted drafts,
then one token of the target) and its `drafted_tokens` / `verified_tokens` / `accepted_tokens`.
The front decodes the ids one token at a time with the pair's tokenizer (the entry's own
decoder, avspec.runtime.hf_tokenizer, so the text is the entry's text) and cuts them at stop
strings and `max_tokens` (front.openai.stop_text); usage counts the tokens of the text returned,
up to the token that completed a stop string, and the prompt's tokens as the entry counted them
when it tokenized the prompt (its `prompt_tokens` output: the front never tokenizes a prompt).
Once a stop string ends the text, the upstream call is closed: Triton cancels the request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import aiohttp

from avspec.runtime.hf_tokenizer import HFIncrementalDecoder, HFTokenizer
from avspec.serving.front.http_status import HttpError, error_message
from avspec.serving.front.http_upstream import Upstream
from avspec.serving.front.openai.errors import OpenAIError, entry_error
from avspec.serving.front.openai.prompt import Prompt
from avspec.serving.front.openai.request import EXTRAS, Sampling
from avspec.serving.front.openai.stop_text import Piece, StopText
from avspec.serving.front.schema import GenerateSchema, check_generate_body

_ERROR_BODY_LIMIT = 64 << 10
_EVENT_PREFIX = b"data:"  # Triton's events are `data: {json}` lines (text/event-stream)


@dataclass
class Figures:
    """What speculation did for one request: drafts proposed, verified, accepted; steps."""

    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Step:
    """The text one decode step released, piece by piece, and that step's figures."""

    pieces: list[Piece]
    figures: Figures = field(default_factory=Figures)

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)


class Generation:
    """One request to the entry; iterate `steps()`, then read finish_reason, usage, figures."""

    def __init__(
        self,
        upstream: Upstream,
        tokenizer: HFTokenizer,
        schema: GenerateSchema,
        model: str,
        prompt: Prompt,
        sampling: Sampling,
        prompt_param: str = "prompt",
    ) -> None:
        self.sampling = sampling
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = 0  # as the entry tokenized the prompt (its `prompt_tokens`)
        self.figures = Figures()
        self._upstream, self._tokenizer, self._model = upstream, tokenizer, model
        # the OpenAI field an entry error about an input is about (front.openai.errors)
        self._params = {**_ENTRY_PARAMS, "text_input": prompt_param, "plain_spans": prompt_param}
        self._body = _entry_body(prompt, sampling, schema)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def steps(self, identity: str) -> AsyncIterator[Step]:
        """The text step by step (empty steps skipped); OpenAIError for the entry's errors."""
        answer = await self._send(identity)
        decoder = self._tokenizer.incremental_decoder()
        text = StopText(self.sampling.stop)
        try:
            async for line in answer.content:
                if not line.startswith(_EVENT_PREFIX):
                    continue
                event = json.loads(line[len(_EVENT_PREFIX) :])
                if "error" in event:
                    raise entry_error(str(event["error"]), self._params)
                step = self._step(event, decoder, text)
                if step.pieces:
                    yield step
                if self.finish_reason is not None:
                    return  # the `finally` closes the call: Triton cancels the rest
        except (aiohttp.ClientError, ValueError) as err:
            raise OpenAIError(502, f"the answer of the entry model broke off ({err!r})") from None
        finally:
            answer.close()
        self.finish_reason = "stop"  # the entry ended it: EOS
        if not text.stopped:  # the decoder's held-back bytes may still complete a stop string
            text.add(decoder.flush(), draft=False)
        last = text.release() if text.stopped else text.flush()
        if last:
            yield Step(last)

    def _step(self, event: dict, decoder: HFIncrementalDecoder, text: StopText) -> Step:
        self.prompt_tokens = int(event.get("prompt_tokens", self.prompt_tokens))
        ids = event.get("output_ids", [])
        ids = [ids] if isinstance(ids, int) else list(ids)
        figures = Figures(
            int(event.get("drafted_tokens", 0)),
            int(event.get("verified_tokens", 0)),
            int(event.get("accepted_tokens", 0)),
            1,
        )
        for name, value in figures.as_dict().items():
            setattr(self.figures, name, getattr(self.figures, name) + value)
        for position, token_id in enumerate(ids):
            self.completion_tokens += 1
            stopped = text.add(decoder.push([token_id]), draft=position < figures.accepted_tokens)
            if stopped:
                self.finish_reason = "stop"
                break
            if self.completion_tokens >= self.sampling.max_tokens:
                self.finish_reason = "length"
                # the text ends with whole characters: a cut one is left out, never U+FFFD
                text.add(decoder.flush(incomplete=False), draft=False)
                if not text.stopped:
                    return Step(text.flush(), figures)
                break
        return Step(text.release(), figures)

    async def _send(self, identity: str) -> aiohttp.ClientResponse:
        path = f"/v2/models/{self._model}/generate_stream"
        headers = [("Content-Type", "application/json")]
        try:
            answer = await self._upstream.send(
                "POST", path, headers, identity, self._body(identity)
            )
        except HttpError as err:
            raise OpenAIError(err.status, err.message) from None
        if answer.status == 200:
            return answer
        try:
            body = await answer.content.read(_ERROR_BODY_LIMIT)
        finally:
            answer.close()
        message = error_message(body) or body.decode("utf-8", "replace") or "no message"
        if answer.status == 400:
            raise entry_error(message, self._params)
        raise OpenAIError(answer.status, message)


# entry inputs -> the OpenAI fields they come from (text_input: the route's prompt field)
_ENTRY_PARAMS = {name: name for name in ("max_tokens", "temperature", "top_p", *EXTRAS)} | {
    "random_seed": "seed"
}


def _entry_body(
    prompt: Prompt, sampling: Sampling, schema: GenerateSchema
) -> Callable[[str], bytes]:
    """The generate_stream body for an identity (checked against the entry's inputs once)."""
    inputs: dict[str, object] = {
        "text_input": prompt.text,
        "max_tokens": sampling.max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "stream": True,
        **sampling.extras,
    }
    if sampling.seed is not None:
        inputs["random_seed"] = sampling.seed
    if prompt.plain_spans:
        inputs["plain_spans"] = list(prompt.plain_spans)
    try:
        check_generate_body(json.dumps(inputs, allow_nan=False).encode(), schema)
    except ValueError as err:
        name = next((n for n in sampling.extras if repr(n) in str(err)), None)
        raise OpenAIError(400, str(err), param=name) from None

    def body(identity: str) -> bytes:
        return json.dumps({**inputs, "avspec-client": identity}).encode()

    return body
