"""`POST /v1/chat/completions`: messages through the pair's chat template, then the public model.

The prompt is the chat template's text with the generation prompt added
(front.openai.chat_template). When the tokenizer prepends BOS itself and the template writes it
too, the template's BOS text is removed from the prompt: the entry encodes its prompt with BOS,
and transformers' `apply_chat_template` encodes without adding special tokens, so either way the
model sees one BOS.
"""

from __future__ import annotations

from aiohttp import web

from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.answer import CHAT, Answer
from avspec.serving.front.openai.chat_template import ChatTemplateError
from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.errors import OpenAIError, field_error
from avspec.serving.front.openai.generation import Generation
from avspec.serving.front.openai.request import parse_chat

DEFAULT_MAX_TOKENS = 256  # when a request names no max_tokens / max_completion_tokens


async def chat_completions(
    context: Context, request: web.BaseRequest, body: bytes, identity: str, call: Abortable | None
) -> web.StreamResponse:
    """Answer one chat completion request (see front.openai.answer for the shape)."""
    parsed = parse_chat(body, DEFAULT_MAX_TOKENS)
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
        prompt = template.render(parsed.messages, add_generation_prompt=True)
    except ChatTemplateError as err:
        raise field_error("messages", str(err)) from None
    tokenizer = context.tokenizer()
    bos = template.special_tokens.get("bos_token")
    if tokenizer.add_bos and isinstance(bos, str) and bos and prompt.startswith(bos):
        prompt = prompt[len(bos) :]
    generation = Generation(
        context.upstream, tokenizer, context.schema, model, prompt, parsed.sampling
    )
    answer = Answer(request, CHAT, model, generation, identity, call, context.write_timeout_s)
    return await answer.run()
