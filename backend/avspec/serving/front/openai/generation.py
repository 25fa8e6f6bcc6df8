"""One OpenAI request as a generation of the engine, its text rebuilt token by token.

The engine (front.openai.engine.Engine: the entry model on Triton) takes the prompt and the
sampling with the caller's identity and streams decode steps: the step's token ids (the accepted
drafts, then one token of the target) and its drafted / verified / accepted counts. The front
decodes the ids one token at a time with the pair's tokenizer (the entry's own decoder,
avspec.runtime.hf_tokenizer, so the text is the entry's text) and cuts them at stop strings and
`max_tokens` (front.openai.stop_text); usage counts the tokens of the text returned, up to the
token that completed a stop string, and the prompt's tokens as the engine counted them when it
tokenized the prompt (the front never tokenizes a prompt). Once a stop string ends the text, the
engine's iterator is closed: the engine cancels the request.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, field

from avspec.runtime.hf_tokenizer import HFIncrementalDecoder, HFTokenizer
from avspec.serving.front.openai.engine import Engine, EngineRequest, EngineStep
from avspec.serving.front.openai.prompt import Prompt
from avspec.serving.front.openai.request import Sampling
from avspec.serving.front.openai.stop_text import Piece, StopText


@dataclass
class Figures:
    """What speculation did for one request: drafts proposed, verified, accepted; steps."""

    drafted_tokens: int = 0
    verified_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class Step:
    """The text one decode step released, piece by piece, and that step's figures."""

    pieces: list[Piece]
    figures: Figures = field(default_factory=Figures)

    @property
    def text(self) -> str:
        return "".join(piece.text for piece in self.pieces)


class Generation:
    """One request to the engine; iterate `steps()`, then read finish_reason, usage, figures."""

    def __init__(
        self, engine: Engine, tokenizer: HFTokenizer, model: str, prompt: Prompt, sampling: Sampling
    ) -> None:
        self.sampling = sampling
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.prompt_tokens = 0  # as the engine tokenized the prompt
        self.figures = Figures()
        self._engine, self._tokenizer = engine, tokenizer
        self._request = EngineRequest(model, prompt, sampling)

    def usage(self) -> dict[str, int]:
        prompt, completion = self.prompt_tokens, self.completion_tokens
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def steps(self, identity: str) -> AsyncGenerator[Step, None]:
        """The text step by step (empty steps skipped); OpenAIError for the engine's errors."""
        decoder = self._tokenizer.incremental_decoder()
        text = StopText(self.sampling.stop)
        async with aclosing(self._engine.generate(self._request, identity)) as steps:  # type: ignore[type-var]
            async for engine_step in steps:
                step = self._step(engine_step, decoder, text)
                if step.pieces:
                    yield step
                if self.finish_reason is not None:
                    return  # leaving `aclosing` closes the generation: the engine cancels it
        self.finish_reason = "stop"  # the engine ended it: EOS
        if not text.stopped:  # the decoder's held-back bytes may still complete a stop string
            text.add(decoder.flush(), draft=False)
        last = text.release() if text.stopped else text.flush()
        if last:
            yield Step(last)

    def _step(self, engine_step: EngineStep, decoder: HFIncrementalDecoder, text: StopText) -> Step:
        if engine_step.prompt_tokens is not None:
            self.prompt_tokens = engine_step.prompt_tokens
        figures = Figures(
            engine_step.drafted_tokens,
            engine_step.verified_tokens,
            engine_step.accepted_tokens,
            1,
        )
        for name, value in figures.as_dict().items():
            setattr(self.figures, name, getattr(self.figures, name) + value)
        for position, token_id in enumerate(engine_step.output_ids):
            self.completion_tokens += 1
            stopped = text.add(decoder.push([token_id]), draft=position < figures.accepted_tokens)
            if stopped:
                self.finish_reason = "stop"
                break
            if self.completion_tokens >= self.sampling.max_tokens:
                self.finish_reason = "length"
                # the text ends with whole characters: a cut one is left out, never U+FFFD
                text.add(decoder.flush(incomplete=False), draft=False)
                if not text.stopped:
                    return Step(text.flush(), figures)
                break
        return Step(text.release(), figures)
