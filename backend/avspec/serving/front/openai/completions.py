"""`POST /v1/completions`: a prompt continued by the public model, as the OpenAI API answers it."""

from __future__ import annotations

from aiohttp import web

from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.answer import COMPLETION, Answer
from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.generation import Generation
from avspec.serving.front.openai.request import parse_completion

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


async def completions(
    context: Context, request: web.BaseRequest, body: bytes, identity: str, call: Abortable | None
) -> web.StreamResponse:
    """Answer one completion request (see front.openai.answer for the shape)."""
    parsed = parse_completion(body, DEFAULT_MAX_TOKENS)
    model = context.served_model(parsed.model)
    generation = Generation(
        context.upstream, context.tokenizer(), context.schema, model, parsed.prompt, parsed.sampling
    )
    answer = Answer(request, COMPLETION, model, generation, identity, call, context.write_timeout_s)
    return await answer.run()
