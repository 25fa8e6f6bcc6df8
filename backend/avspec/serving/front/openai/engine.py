"""What the OpenAI routes need of the engine behind them: one protocol, `Engine`.

A route submits a request (the public model's name, the prompt, the sampling) and reads the
decode steps back; closing the iterator (`aclose`, or leaving an `aclosing` block) cancels the
request. The engine owns tokenizing the prompt: it reports the count (`EngineStep.prompt_tokens`),
and the routes never see its inputs or outputs as tensors. The front's engine is the entry model
on Triton (front.openai.triton_engine.TritonEngine).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from avspec.serving.front.openai.prompt import Prompt
from avspec.serving.front.openai.request import Sampling


@dataclass(frozen=True)
class EngineRequest:
    """One generation: the public model that runs it, the prompt, how to sample."""

    model: str
    prompt: Prompt
    sampling: Sampling


@dataclass(frozen=True)
class EngineStep:
    """One decode step: its tokens (the accepted drafts, then one of the target), what
    speculation did in it, and the prompt's token count as the engine tokenized it."""

    output_ids: tuple[int, ...]
    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    prompt_tokens: int | None = None  # None: not told in this step


class Engine(Protocol):
    """Generation behind the OpenAI routes."""

    def generate(self, request: EngineRequest, identity: str) -> AsyncIterator[EngineStep]:
        """Submit `request` for the client `identity` and yield its decode steps until the
        engine ends it (EOS or its own limit); closing the iterator cancels it. A refusal or
        a failure is an OpenAIError (param: the OpenAI field it is about), raised by the first
        step when the engine refuses the request outright."""
        ...
