"""`GET /v1/models`: the public models, as the OpenAI API lists models."""

from __future__ import annotations

from aiohttp import web

from avspec.serving.front.openai.context import Context
from avspec.serving.front.openai.response import ModelCard, ModelList


async def list_models(context: Context) -> web.Response:
    data = [
        ModelCard(id=name, object="model", created=context.created, owned_by="avspec")
        for name in context.config.public_models
    ]
    return web.json_response(ModelList(object="list", data=data).body())
