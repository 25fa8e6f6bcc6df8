"""What the OpenAI routes share: the front's config, the client to Triton, the pair's tokenizer
and chat template (loaded once, when the front starts), and which model names they serve."""

from __future__ import annotations

import time

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.http_upstream import Upstream
from avspec.serving.front.openai.chat_template import ChatTemplate
from avspec.serving.front.openai.errors import OpenAIError
from avspec.serving.front.policy import model_refusal


class Context:
    """Shared by the OpenAI routes of one front."""

    def __init__(self, config: FrontConfig, upstream: Upstream) -> None:
        self.config = config
        self.upstream = upstream
        self.schema = config.generate_schema
        self.write_timeout_s = config.read_timeout_s
        self.created = int(time.time())
        directory = config.tokenizer_dir
        self._tokenizer = HFTokenizer.from_directory(directory) if directory is not None else None
        self._template = ChatTemplate.from_directory(directory) if directory is not None else None

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
