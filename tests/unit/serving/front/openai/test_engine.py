"""front.openai.engine: the routes' generation runs on any `Engine` (here an in-memory one, no
Triton, no tensors); closing the steps cancels the engine's request. front.openai.triton_engine:
an input the public model does not take is a 400 naming the OpenAI field, before any call.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import MappingProxyType

import pytest

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.serving.front.openai.engine import Engine, EngineRequest, EngineStep
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.generation import Generation
from avspec.serving.front.openai.prompt import Prompt
from avspec.serving.front.openai.request import Sampling
from avspec.serving.front.openai.triton_engine import TritonEngine
from avspec.serving.front.schema import DEFAULT_GENERATE_SCHEMA


class ListEngine:
    """An Engine that answers every request with the same steps, and notes what happened."""

    def __init__(self, steps: list[EngineStep]) -> None:
        self.steps, self.requests, self.closed = steps, [], False

    async def generate(self, request: EngineRequest, identity: str) -> AsyncIterator[EngineStep]:
        self.requests.append((request, identity))
        try:
            for step in self.steps:
                yield step
        finally:
            self.closed = True


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir) -> HFTokenizer:
    return HFTokenizer.from_directory(tokenizer_dir)  # the byte tokenizer (../conftest.py)


def ids(tokenizer: HFTokenizer, text: str) -> tuple[int, ...]:
    return tuple(tokenizer.encode(text, ((0, len(text)),)))


def run(generation: Generation) -> str:
    async def collect() -> str:
        return "".join([step.text async for step in generation.steps("someone")])

    return asyncio.run(collect())


def test_a_generation_runs_on_any_engine(tokenizer):
    engine = ListEngine(
        [EngineStep(ids(tokenizer, "ab"), 2, 2, 1, 7), EngineStep(ids(tokenizer, "c"), 0, 0, 0)]
    )
    as_engine: Engine = engine  # structural: no base class needed
    prompt, sampling = Prompt("hi"), Sampling(max_tokens=8)
    generation = Generation(as_engine, tokenizer, "speculative", prompt, sampling)
    assert run(generation) == "abc" and generation.finish_reason == "stop"
    assert generation.usage() == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    assert generation.figures.as_dict() == {
        "drafted_tokens": 2, "verified_tokens": 2, "accepted_tokens": 1, "steps": 2,
    }  # fmt: skip
    ((request, identity),) = engine.requests
    assert (request.model, request.prompt, request.sampling, identity) == (
        "speculative", prompt, sampling, "someone",
    )  # fmt: skip


def test_a_stop_string_closes_the_engines_request(tokenizer):
    engine = ListEngine(
        [EngineStep(ids(tokenizer, "abXY"))] + [EngineStep(ids(tokenizer, "z"))] * 9
    )
    generation = Generation(
        engine, tokenizer, "speculative", Prompt("hi"), Sampling(max_tokens=64, stop=("XY",))
    )
    assert run(generation) == "ab" and generation.finish_reason == "stop"
    assert engine.closed  # the engine's iterator was closed at the stop: the request cancelled


def test_an_input_the_public_model_lacks_is_400_before_any_call():
    schema = MappingProxyType(
        {k: v for k, v in DEFAULT_GENERATE_SCHEMA.items() if k != "num_draft_tokens"}
    )
    engine = TritonEngine(upstream=None, schema=schema)  # never reached
    sampling = Sampling(max_tokens=4, extras={"num_draft_tokens": 2})
    request = EngineRequest("speculative", Prompt("x", field="messages"), sampling)

    async def first() -> None:
        await anext(engine.generate(request, "someone"))

    with pytest.raises(OpenAIError) as err:
        asyncio.run(first())
    assert err.value.status == 400 and err.value.param == "num_draft_tokens"
    assert "'num_draft_tokens'" in err.value.message
