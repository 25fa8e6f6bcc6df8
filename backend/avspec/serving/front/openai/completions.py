"""`POST /v1/completions`: a prompt continued by the public model, as the OpenAI API answers it.

The prompt is plain text to the entry (special-token strings in it are text) unless the operator
lets prompts spell special tokens (front.openai.prompt).
"""

from __future__ import annotations

from aiohttp import web

from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.answer import COMPLETION, Answer
from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.generation import Generation
from avspec.serving.front.openai.prompt import Prompt, completion_prompt
from avspec.serving.front.openai.request import CompletionRequest, Sampling, parse_completion

DEFAULT_MAX_TOKENS = 16  # the OpenAI API's default for completions


async def completions(
    context: Context, request: web.BaseRequest, body: bytes, identity: str, call: Abortable | None
) -> web.StreamResponse:
    """Answer one completion request (see front.openai.answer for the shape)."""
    tokenizer = context.tokenizer()
    special = context.config.access.completions_special_tokens

    def prepare() -> tuple[CompletionRequest, Sampling, Prompt]:
        parsed, sampling = parse_completion(body, DEFAULT_MAX_TOKENS)
        context.served_model(parsed.model)
        return parsed, sampling, completion_prompt(parsed.text, special)

    parsed, sampling, prompt = await context.prepare(identity, prepare)
    generation = Generation(context.engine, tokenizer, parsed.model, prompt, sampling)
    answer = Answer(
        request, COMPLETION, parsed.model, generation, identity, call, context.write_timeout_s
    )
    return await answer.run()
