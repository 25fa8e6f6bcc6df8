"""The prompt the entry model gets for an OpenAI request: its text and its plain spans.

Only the chat template may place special tokens. A client's text (a message's content, a
completion's prompt) is text: a message containing `<|im_end|>\n<|im_start|>system\n...` must
reach the model as those characters, not as the tokens that end the user's turn and open a
system turn. So the front sends the entry `plain_spans`, the UTF-8 byte ranges of `text_input`
that the entry tokenizes as text (avspec.serving.stages.requests), and the entry, which
tokenizes every prompt once and reports its count (`prompt_tokens`), never sees content as markup:

- chat: the template is rendered with a marker in place of each content
  (chat_template.render_marked), and each content's place in the text is a plain span. A template
  that rewrites contents (slices, splits) gives no places; then the text is sent without spans
  and a content holding a special token's text is refused (400 naming the message);
- completions: the whole prompt is plain, unless the operator lets prompts spell special tokens
  (FrontConfig.completions_special_tokens, `--completions-special-tokens`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.serving.front.openai.chat_template import ChatTemplate, render_marked
from avspec.serving.front.openai.errors import field_error


@dataclass(frozen=True)
class Prompt:
    """`text_input` and `plain_spans` (flat [start, end, ...] UTF-8 byte offsets) of a request,
    and the OpenAI field it was made from (named by an error about the prompt)."""

    text: str
    plain_spans: tuple[int, ...] = ()
    field: str = "prompt"


def completion_prompt(text: str, special_tokens: bool) -> Prompt:
    """A completion's prompt: all plain, or (operator's choice) as written."""
    return Prompt(text) if special_tokens else Prompt(text, (0, len(text.encode("utf-8"))))


def chat_prompt(
    template: ChatTemplate, tokenizer: HFTokenizer, messages: list[dict[str, Any]]
) -> Prompt:
    """The chat prompt of `messages` (generation prompt added), contents plain.

    When the tokenizer prepends BOS itself and the template writes it too, the template's BOS
    text is removed: the entry encodes with BOS, and transformers' `apply_chat_template`
    encodes without adding special tokens, so either way the model sees one BOS.
    """
    marked = render_marked(template, messages)
    spans: tuple[tuple[int, int], ...]
    if marked is None:
        _refuse_special_text(tokenizer, messages)
        text, spans = template.render(messages, add_generation_prompt=True), ()
    else:
        text, spans = marked.text, marked.content
    bos = template.special_tokens.get("bos_token")
    if tokenizer.add_bos and isinstance(bos, str) and bos and text.startswith(bos):
        text = text[len(bos) :]
        spans = tuple((a - len(bos), b - len(bos)) for a, b in spans)
    return Prompt(text, _byte_offsets(text, spans), field="messages")


def _byte_offsets(text: str, spans: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """Character spans of `text` as flat UTF-8 byte offsets."""
    flat, done, at = [], 0, 0
    for start, end in spans:
        for edge in (start, end):
            at += len(text[done:edge].encode("utf-8"))
            done = edge
            flat.append(at)
    return tuple(flat)


def _refuse_special_text(tokenizer: HFTokenizer, messages: list[dict[str, Any]]) -> None:
    specials = [t for i in sorted(tokenizer.special_ids) if (t := tokenizer.token(i))]
    for index, message in enumerate(messages):
        found = next((t for t in specials if t in message["content"]), None)
        if found is not None:
            where = f"messages[{index}].content"
            raise field_error(
                where,
                f"{where} holds the special token text {found!r}, which this model's chat "
                "template cannot keep apart from its own markup",
            )
