"""`POST /v1/chat/completions`: messages through the pair's chat template, then the public model.

The body is parsed and the template rendered off the event loop (Context.prepare: a large
conversation costs tens of milliseconds of Python), the contents marked as plain text for the
entry (front.openai.prompt).
"""

from __future__ import annotations

from aiohttp import web

from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.answer import CHAT, Answer
from avspec.serving.front.openai.chat_template import ChatTemplateError
from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.errors import OpenAIError, field_error
from avspec.serving.front.openai.generation import Generation
from avspec.serving.front.openai.prompt import Prompt, chat_prompt
from avspec.serving.front.openai.request import ChatRequest, Sampling, parse_chat

DEFAULT_MAX_TOKENS = 256  # when a request names no max_tokens / max_completion_tokens


async def chat_completions(
    context: Context, request: web.BaseRequest, body: bytes, identity: str, call: Abortable | None
) -> web.StreamResponse:
    """Answer one chat completion request (see front.openai.answer for the shape)."""
    tokenizer = context.tokenizer()

    def prepare() -> tuple[ChatRequest, Sampling, Prompt]:
        parsed, sampling = parse_chat(body, DEFAULT_MAX_TOKENS)
        model = context.served_model(parsed.model)
        template = context.chat_template()
        if template is None:
            raise OpenAIError(
                400,
                f"model {model!r} has no chat template (its tokenizer_config.json names none): "
                "use /v1/completions",
                param="messages",
                code="no_chat_template",
            )
        try:
            return parsed, sampling, chat_prompt(template, tokenizer, parsed.template_messages())
        except ChatTemplateError as err:
            raise field_error("messages", str(err)) from None

    parsed, sampling, prompt = await context.prepare(identity, prepare)
    generation = Generation(context.engine, tokenizer, parsed.model, prompt, sampling)
    answer = Answer(
        request, CHAT, parsed.model, generation, identity, call, context.write_timeout_s
    )
    return await answer.run()
