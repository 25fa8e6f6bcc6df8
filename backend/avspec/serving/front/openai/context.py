"""What the OpenAI routes share: the front's config, the engine (the entry model on Triton,
through the front's client to it), the pair's tokenizer and chat template (loaded once, when the
front starts), which model names they serve, and the pool that prepares requests off the event
loop."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.http_upstream import Upstream
from avspec.serving.front.openai.chat_template import ChatTemplate
from avspec.serving.front.openai.engine import Engine
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.openai.triton_engine import TritonEngine
from avspec.serving.front.policy import model_refusal, shown

T = TypeVar("T")

PREPARE_WORKERS = 2
# requests of one identity waiting to be prepared past the one being prepared; more get 429.
# As many as one address may hold connections (FrontConfig.max_per_address): a client running
# 16 or 64 requests at once is never refused here (a first cut of 4 refused a benchmark's
# concurrency-8 warm-up); each waits for the one before it, about a millisecond for a chat.
MAX_WAITING_PER_IDENTITY = 128


class Context:
    """Shared by the OpenAI routes of one front."""

    def __init__(self, config: FrontConfig, upstream: Upstream) -> None:
        self.config = config
        self.engine: Engine = TritonEngine(upstream, config.generate_schema)
        self.write_timeout_s = config.read_timeout_s
        self.created = int(time.time())
        directory = config.tokenizer_dir
        self._tokenizer = HFTokenizer.from_directory(directory) if directory is not None else None
        self._template = ChatTemplate.from_directory(directory) if directory is not None else None
        self._pool: ThreadPoolExecutor | None = None
        self._turns: dict[str, asyncio.Lock] = {}
        self._waiting: Counter[str] = Counter()

    def tokenizer(self) -> HFTokenizer:
        """The pair's tokenizer; 501 when the front was given none (FrontConfig.tokenizer_dir)."""
        if self._tokenizer is None:
            raise OpenAIError(501, "this front serves no OpenAI completions: no tokenizer given")
        return self._tokenizer

    def chat_template(self) -> ChatTemplate | None:
        return self._template

    def served_model(self, name: str) -> str:
        """`name` if it is a public model; 404 (unknown) or 403 (internal) otherwise."""
        if name in self.config.public_models:
            return name
        internal, message = model_refusal(self.config, name)
        code = "model_not_allowed" if internal else "model_not_found"
        raise OpenAIError(403 if internal else 404, message, param="model", code=code)

    async def prepare(self, identity: str, work: Callable[[], T]) -> T:
        """Run `work` (parse a body, render a template) on a small thread pool, one request of
        an identity at a time: a client sending large conversations waits for its own, never
        fills the pool for others. Past MAX_WAITING_PER_IDENTITY waiting, 429 at once."""
        if self._waiting[identity] > MAX_WAITING_PER_IDENTITY:
            raise OpenAIError(
                429,
                f"too many requests of client {shown(identity)} are being prepared; retry later",
                code="rate_limit_exceeded",
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PREPARE_WORKERS, thread_name_prefix="avspec-prepare")
        turn = self._turns.setdefault(identity, asyncio.Lock())
        self._waiting[identity] += 1
        try:
            async with turn:
                return await asyncio.get_running_loop().run_in_executor(self._pool, work)
        finally:
            self._waiting[identity] -= 1
            if not self._waiting[identity]:
                del self._waiting[identity]
                self._turns.pop(identity, None)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
