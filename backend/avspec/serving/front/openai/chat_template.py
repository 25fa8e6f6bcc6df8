"""The pair's chat template, rendered the way `transformers` renders it (`apply_chat_template`).

The template is the target directory's `chat_template.jinja`, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of named templates: "default" is used). It runs in Jinja's
ImmutableSandboxedEnvironment, as in transformers: a template from a model download cannot reach
Python objects or mutate what it is given, and `trim_blocks` / `lstrip_blocks`, the
`loopcontrols` extension, the `{% generation %}` tag (rendered as its body), a `tojson` that does
not escape HTML, `raise_exception` and `strftime_now` make the same templates render the same
text. The variables are `messages`, `add_generation_prompt`, `tools` and `documents` (None), and
the special tokens of the tokenizer config (`bos_token`, `eos_token`, ...), as transformers'
`special_tokens_map` passes them. tests/unit/serving/front/openai/test_chat_template.py compares
the text with `apply_chat_template` of transformers for real templates.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from avspec.runtime.hf_files import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE

TEMPLATE_FILE = "chat_template.jinja"
# transformers' SPECIAL_TOKENS_ATTRIBUTES, the names a template may use
SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens",
)  # fmt: skip


class ChatTemplateError(ValueError):
    """A template that does not load, or a conversation it refuses (its `raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's text for training
    masks in transformers; for serving it is its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: jinja2.runtime.Macro) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment


def _token_text(value: Any) -> Any:
    """A special token as a template sees it: its text (an AddedToken dict's `content`)."""
    if isinstance(value, dict):
        return value.get("content")
    if isinstance(value, list):
        return [_token_text(item) for item in value]
    return value


class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, Any] | None = None) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as err:
            raise ChatTemplateError(f"chat template does not compile: {err}") from None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_directory(cls, directory: Path | str) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None if it has none."""
        directory = Path(directory)
        config = _read_object(directory / TOKENIZER_CONFIG_FILE)
        special = _read_object(directory / SPECIAL_TOKENS_MAP_FILE)
        tokens = {
            name: _token_text(config.get(name, special.get(name)))
            for name in SPECIAL_TOKENS
            if config.get(name, special.get(name)) is not None
        }
        template_file = directory / TEMPLATE_FILE
        source = (
            template_file.read_text(encoding="utf-8")
            if template_file.is_file()
            else _default_template(config.get("chat_template"))
        )
        return None if source is None else cls(source, tokens)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text of `messages`; ChatTemplateError when the template refuses them."""
        try:
            return self._template.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as err:  # raise_exception, and the sandbox's SecurityError
            raise ChatTemplateError(f"the chat template refused the messages: {err}") from None


@dataclass(frozen=True)
class MarkedPrompt:
    """A rendered prompt and the (start, end) character spans of it that are message content:
    text a client wrote, to be tokenized as text (special-token strings in it stay text)."""

    text: str
    content: tuple[tuple[int, int], ...]


def render_marked(
    template: ChatTemplate, messages: list[dict[str, Any]], add_generation_prompt: bool = True
) -> MarkedPrompt | None:
    """`template.render`, knowing where each message's content landed; None when the template
    does not place contents as given (it slices, splits or rewrites them), so they cannot be
    told from its own text.

    Each content is rendered as a marker (private-use characters around a nonce and the
    message's index), the markers are found in order, once each, and the contents put back.
    """
    nonce = secrets.token_hex(8)
    markers = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    stand_ins = [{**m, "content": marker} for m, marker in zip(messages, markers, strict=True)]
    text = template.render(stand_ins, add_generation_prompt)
    parts, spans, edge, length = [], [], 0, 0
    for message, marker in zip(messages, markers, strict=True):
        at = text.find(marker, edge)
        if at < 0 or text.find(marker, at + len(marker)) >= 0:
            return None
        parts.append(text[edge:at])
        length += at - edge
        content = message["content"]
        parts.append(content)
        if content:
            spans.append((length, length + len(content)))
        length += len(content)
        edge = at + len(marker)
    rest = text[edge:]
    if "\ue000" + nonce in rest:
        return None
    return MarkedPrompt("".join(parts) + rest, tuple(spans))


def _default_template(value: Any) -> str | None:
    """tokenizer_config's `chat_template`: a string, or named templates of which "default"."""
    if isinstance(value, list):
        named = {item.get("name"): item.get("template") for item in value if isinstance(item, dict)}
        value = named.get("default")
    return value if isinstance(value, str) else None


def _read_object(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise ChatTemplateError(f"{path} is not valid JSON: {err}") from None
    return data if isinstance(data, dict) else {}
