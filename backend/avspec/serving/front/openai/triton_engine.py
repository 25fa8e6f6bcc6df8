"""The Engine of the OpenAI routes: the entry model's `generate_stream` on Triton's HTTP port.

A request becomes the entry's own inputs (`text_input` and `plain_spans`, `max_tokens`,
`temperature`, `top_p`, `random_seed`, `stream` true, the speculative settings) with the
caller's identity (`avspec-client`, as on /v2), so the same admission, fairness and refit-share
rules apply; the entry tokenizes the prompt (once, off its serving thread) and reports the count.
Each server-sent event of Triton's answer is one decode step (`output_ids`, `drafted_tokens`,
`verified_tokens`, `accepted_tokens`, `prompt_tokens`). Closing the answer makes Triton cancel
the request. The values were validated at the OpenAI boundary (front.openai.request); here only
the public model's inputs are consulted (its config.pbtxt, FrontConfig.generate_schema): an input
it does not take is a 400, never a silently dropped setting.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping

import aiohttp

from avspec.serving.front.http_status import HttpError, entry_error_status, error_message
from avspec.serving.front.http_upstream import Upstream
from avspec.serving.front.openai.engine import EngineRequest, EngineStep
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.request import EXTRAS
from avspec.serving.front.schema import GenerateSchema

_ERROR_BODY_LIMIT = 64 << 10
_EVENT_PREFIX = b"data:"  # Triton's events are `data: {json}` lines (text/event-stream)
# entry inputs -> the OpenAI fields they come from (text_input: the route's prompt field)
_ENTRY_PARAMS = {name: name for name in ("max_tokens", "temperature", "top_p", *EXTRAS)} | {
    "random_seed": "seed"
}


class TritonEngine:
    """`Engine` over the front's client to Triton (`Upstream`) and the public model's inputs."""

    def __init__(self, upstream: Upstream, schema: GenerateSchema) -> None:
        self.upstream, self.schema = upstream, schema

    async def generate(self, request: EngineRequest, identity: str) -> AsyncIterator[EngineStep]:
        params = {**_ENTRY_PARAMS, "text_input": request.prompt.field}
        params["plain_spans"] = request.prompt.field
        body = json.dumps({**self._inputs(request, params), "avspec-client": identity})
        answer = await self._send(request.model, identity, body.encode(), params)
        try:
            async for line in answer.content:
                if not line.startswith(_EVENT_PREFIX):
                    continue
                event = json.loads(line[len(_EVENT_PREFIX) :])
                if "error" in event:
                    raise entry_error(str(event["error"]), params)
                yield _step(event)
        except (aiohttp.ClientError, ValueError) as err:
            raise OpenAIError(502, f"the answer of the entry model broke off ({err!r})") from None
        finally:
            answer.close()

    def _inputs(self, request: EngineRequest, params: Mapping[str, str]) -> dict[str, object]:
        sampling = request.sampling
        inputs: dict[str, object] = {
            "text_input": request.prompt.text,
            "max_tokens": sampling.max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "stream": True,
            **sampling.extras,
        }
        if sampling.seed is not None:
            inputs["random_seed"] = sampling.seed
        if request.prompt.plain_spans:
            inputs["plain_spans"] = list(request.prompt.plain_spans)
        for name in inputs:
            if name not in self.schema:
                raise OpenAIError(
                    400,
                    f"model {request.model!r} takes no input {name!r} (its inputs: "
                    f"{', '.join(self.schema)})",
                    param=params.get(name),
                )
        missing = [n for n, spec in self.schema.items() if spec.required and n not in inputs]
        if missing:
            raise OpenAIError(
                400, f"model {request.model!r} needs the input {missing[0]!r}, which the OpenAI "
                "routes do not send: use /v2/models/.../generate",
            )  # fmt: skip
        return inputs

    async def _send(
        self, model: str, identity: str, body: bytes, params: Mapping[str, str]
    ) -> aiohttp.ClientResponse:
        path = f"/v2/models/{model}/generate_stream"
        headers = [("Content-Type", "application/json")]
        try:
            answer = await self.upstream.send("POST", path, headers, identity, body)
        except HttpError as err:
            raise OpenAIError(err.status, err.message) from None
        if answer.status == 200:
            return answer
        try:
            text = await answer.content.read(_ERROR_BODY_LIMIT)
        finally:
            answer.close()
        message = error_message(text) or text.decode("utf-8", "replace") or "no message"
        if answer.status == 400:
            raise entry_error(message, params)
        raise OpenAIError(answer.status, message)


def _step(event: dict) -> EngineStep:
    ids = event.get("output_ids", [])
    return EngineStep(
        tuple(int(i) for i in ([ids] if isinstance(ids, int) else ids)),
        int(event.get("drafted_tokens", 0)),
        int(event.get("verified_tokens", 0)),
        int(event.get("accepted_tokens", 0)),
        None if "prompt_tokens" not in event else int(event["prompt_tokens"]),
    )


def entry_error(message: str, params: Mapping[str, str] | None = None) -> OpenAIError:
    """An error of the entry model (Triton answered 400 or sent an error event), with the
    status the entry meant: 503 overloaded, 500 a failed stage, 400 the request's mistake.

    The entry's messages start with the input they are about (`max_tokens 600 + 8 draft tokens
    leave no room ...`); `params` maps such an input to the OpenAI field, named in `param`.
    """
    status = entry_error_status(json.dumps({"error": message}).encode())
    code = {503: "overloaded", 500: "generation_failed"}.get(status)
    first = message.split(" ", 1)[0]
    param = (params or {}).get(first) if status == 400 else None
    return OpenAIError(status, message, param=param, code=code)
