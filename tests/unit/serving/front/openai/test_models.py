"""front.openai.models: `GET /v1/models` lists the public model (the official `openai` client)."""

from __future__ import annotations

from helpers.clients import MODEL


def test_models_lists_the_public_model(client):
    assert [model.id for model in client.models.list()] == [MODEL]
