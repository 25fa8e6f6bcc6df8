"""OpenAI-compatible routes on the front's public HTTP port, on top of the entry's generate_stream.

`GET /v1/models` (models), `POST /v1/completions` (completions), `POST /v1/chat/completions`
(chat, with the pair's chat template: chat_template, rendered here, once). A body is validated
once, at the door, against its typed schema (request, validation: a 400 naming the field), sent
to the engine with the caller's identity through one protocol (engine.Engine; the entry model
on Triton: triton_engine, which tokenizes the prompt), its text rebuilt token by token and cut
at stop strings and max_tokens (generation, stop_text), and answered as one JSON object or a
stream of server-sent events in the typed shapes of response (answer); errors are OpenAI error
objects (errors). The front's own rules apply as on /v2: connection caps, body limit, readiness
(503 while a stage restarts), Front.abort_inference. `install` puts the routes on the relay.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from avspec.serving.front.http_relay import HttpRelay
from avspec.serving.front.http_status import HttpError
from avspec.serving.front.inflight import Abortable
from avspec.serving.front.openai.chat import chat_completions
from avspec.serving.front.openai.completions import completions
from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.models import list_models

PREFIX = "/v1/"


def _http_error(err: HttpError) -> web.Response:
    response = OpenAIError(err.status, err.message).response()
    for name, value in err.headers:
        response.headers[name] = value
    return response


def _route(
    context: Context,
    handler: Callable[..., Awaitable[web.StreamResponse]],
) -> Callable[[web.BaseRequest, bytes, str, Abortable | None], Awaitable[web.StreamResponse]]:
    async def serve(
        request: web.BaseRequest, body: bytes, identity: str, call: Abortable | None
    ) -> web.StreamResponse:
        try:
            return await handler(context, request, body, identity, call)
        except OpenAIError as err:
            return err.response()

    return serve


async def _models(context: Context, *_: object) -> web.StreamResponse:
    return await list_models(context)


def install(relay: HttpRelay) -> Context:
    """Serve the OpenAI routes on `relay`; errors under /v1/ become OpenAI error objects."""
    context = Context(relay.config, relay.upstream)
    relay.serve("openai_models", _route(context, _models))
    relay.serve("openai_completions", _route(context, completions))
    relay.serve("openai_chat", _route(context, chat_completions))
    relay.format_errors(PREFIX, _http_error)
    relay.on_close(context.close)
    return context
