"""User messages written by the target itself ("self prompts", the Magpie technique).

An aligned chat model given only its chat template up to the start of a user turn (the
"pre-query": the default system prompt, if the template adds one, then the user header, for
ChatML `<|im_start|>system\\n...<|im_end|>\\n<|im_start|>user\\n`) writes a plausible user
message. The target's answers to such messages are general chat, the distribution the corpus
prompts (`avspec.tools.train.draft.prompts`: code and pydoc text) miss; no downloads are needed.

- `pre_query`: the pre-query text, token ids and stop ids, derived from the template (a
  conversation with a placeholder user message is rendered and cut at the placeholder; the
  first token after the placeholder, when it is a special token, is the end-of-turn token);
- `sample_messages`: N messages sampled from the target on the project's runtime with the draft
  pipeline's continuous batching (`generate.answer_all`), top-p 0.95, at most MAX_MESSAGE_TOKENS
  tokens, stopping at EOS or end-of-turn; each round samples a third of its messages at each of
  the temperatures 0.8, 1.0 and 1.2 (TEMPERATURES: varied topics and wording);
- `rejection`: the filter (why a message is dropped, None to keep it): cut off by the length
  cap, empty, fewer than MIN_WORDS words, a template marker (a special token, the end-of-turn
  text) inside, or a duplicate (case and spacing ignored);
- `sample_self_prompts`: rounds of sampling until `count` messages pass the filter (each round
  sized by the acceptance so far), as `ChatPrompt`s of kind `SELF_KIND`, answered by
  `generate.generate_chunks` like the corpus prompts; deterministic for a seed;
- `cached_self_prompts`: the same, kept in a JSON file (messages and the sampling's figures)
  so a resumed run does not resample them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.generate import (
    MAX_PROMPT_TOKENS,
    AnswerSettings,
    answer_all,
    chat_renderer,
)
from avspec.tools.train.draft.prompts import SELF_KIND, ChatPrompt

PLACEHOLDER = "SELFPROMPTPLACEHOLDER"
MAX_MESSAGE_TOKENS = 64
MIN_WORDS = 3
TEMPERATURES = (0.8, 1.0, 1.2)  # each round's messages split evenly across these
TOP_P = 0.95
MAX_ROUNDS = 16
REASONS = ("cut", "empty", "short", "template", "duplicate")
MESSAGE_SETTINGS = AnswerSettings(64, MAX_MESSAGE_TOKENS, TEMPERATURES[1], TOP_P, keep=1)


@dataclass(frozen=True)
class PreQuery:
    """The template up to where the user's message starts, and what ends the message."""

    text: str
    ids: list[int]
    stop_ids: frozenset[int]  # EOS ids and the template's end-of-turn token
    markers: tuple[str, ...]  # strings a message must not contain (template tokens)


def pre_query(renderer: Any, eos_ids: Iterable[int] = ()) -> PreQuery:
    """The pre-query of `renderer`'s chat template (a `transformers` tokenizer); `eos_ids` (the
    target's EOS ids) stop a message, as does the end-of-turn token the template puts after a
    user message when that is a special token."""
    rendered = renderer.apply_chat_template(
        [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=False, tokenize=False
    )
    if rendered.count(PLACEHOLDER) != 1:
        raise ValueError(
            f"the chat template renders the user message {rendered.count(PLACEHOLDER)} times"
        )
    head, tail = rendered.split(PLACEHOLDER)
    ids = list(renderer.encode(head, add_special_tokens=False))
    if not ids or len(ids) > MAX_PROMPT_TOKENS:
        raise ValueError(f"pre-query of {len(ids)} tokens (1..{MAX_PROMPT_TOKENS} allowed)")
    special = {i: t.content for i, t in renderer.added_tokens_decoder.items() if t.special}
    stops = set(eos_ids)
    after = renderer.encode(tail, add_special_tokens=False)
    if after and after[0] in special:
        stops.add(after[0])
    markers = set(special.values()) | set(renderer.all_special_tokens)
    if tail.strip():
        markers.add(tail.strip().split()[0])  # the end-of-turn text, e.g. "<|im_end|>"
    return PreQuery(head, ids, frozenset(stops), tuple(sorted(m for m in markers if m)))


def normalized(text: str) -> str:
    """The form duplicates are compared in: case folded, whitespace runs as one space."""
    return re.sub(r"\s+", " ", text).strip().casefold()


def rejection(
    text: str,
    finished: bool,
    markers: Sequence[str],
    seen: set[str],
    min_words: int = MIN_WORDS,
) -> str | None:
    """Why a sampled message is dropped (one of REASONS), or None to keep it (then it joins
    `seen`). `finished`: it ended with a stop token, not at the length cap."""
    if not finished:
        return "cut"
    message = text.strip()
    if not message:
        return "empty"
    if len(message.split()) < min_words:
        return "short"
    if any(marker in message for marker in markers):
        return "template"
    key = normalized(message)
    if key in seen:
        return "duplicate"
    seen.add(key)
    return None


def sample_messages(
    model: Transformer,
    renderer: Any,
    query: PreQuery,
    count: int,
    generator: torch.Generator,
    settings: AnswerSettings = MESSAGE_SETTINGS,
    on_token: Callable[[int], None] | None = None,
) -> list[tuple[str, bool]]:
    """`count` messages continuing the pre-query, continuously batched: (text, finished), the
    text without its stop token, decoded with special tokens kept (so the filter sees them)."""
    answers = answer_all(model, [query.ids] * count, query.stop_ids, settings, generator, on_token)
    messages = []
    for answer in answers:
        ids = answer["answer"].tolist()
        finished = bool(ids) and ids[-1] in query.stop_ids
        body = ids[:-1] if finished else ids
        text = renderer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        messages.append((text, finished))
    return messages


def sample_self_prompts(
    target_dir: Path | str,
    count: int,
    seed: int = 0,
    settings: AnswerSettings = MESSAGE_SETTINGS,
    temperatures: Sequence[float] = TEMPERATURES,
    min_words: int = MIN_WORDS,
) -> tuple[list[ChatPrompt], dict[str, Any]]:
    """`count` target-written user messages that pass `rejection` (fewer if MAX_ROUNDS rounds
    of sampling do not find them), each round's messages sampled in equal parts at each of
    `temperatures` (`settings.temperature` is not used), and the sampling's figures: `sampled`,
    `accepted`, `acceptance`, `rejected` (per reason), `tokens`, `seconds`, `tokens_per_s`."""
    renderer = chat_renderer(target_dir)
    query = pre_query(renderer, load_tokenizer(target_dir).eos_ids)
    context = MAX_PROMPT_TOKENS + settings.max_new_tokens  # what `answer_all`'s cache holds
    model = load_model(target_dir, dtype=torch.bfloat16, max_length=context)
    generator = torch.Generator().manual_seed(seed)
    seen: set[str] = set()
    accepted: list[str] = []
    rejected: Counter[str] = Counter()
    sampled = tokens = 0
    start = time.perf_counter()
    bar = tqdm(
        total=0, desc="target user messages (token slots)", file=sys.stderr, mininterval=10.0
    )

    def on_token(n: int) -> None:
        nonlocal tokens
        tokens += n
        bar.update(n)
        rate = tokens / max(time.perf_counter() - start, 1e-9)
        bar.set_postfix(tokens_per_s=f"{rate:.0f}", accepted=len(accepted), refresh=False)

    for _ in range(MAX_ROUNDS):
        missing = count - len(accepted)
        if missing <= 0:
            break
        rate = len(accepted) / sampled if sampled else 0.8
        size = max(math.ceil(missing / max(rate, 0.05) * 1.1), min(settings.batch, missing))
        bar.total += size * settings.max_new_tokens
        bar.refresh()
        before = tokens
        for part, temperature in zip(split(size, len(temperatures)), temperatures, strict=True):
            if not part:
                continue
            at = dataclasses.replace(settings, temperature=temperature)
            for text, finished in sample_messages(
                model, renderer, query, part, generator, at, on_token
            ):
                reason = rejection(text, finished, query.markers, seen, min_words)
                if reason is None and len(accepted) < count:
                    accepted.append(text.strip())
                elif reason is not None:
                    rejected[reason] += 1
        bar.update(size * settings.max_new_tokens - (tokens - before))  # early stops' slots
        sampled += size
    bar.close()
    seconds = time.perf_counter() - start
    if len(accepted) < count:
        print(
            f"self prompts: {len(accepted)} of {count} after {MAX_ROUNDS} rounds", file=sys.stderr
        )
    stats = {
        "sampled": sampled,
        "accepted": len(accepted),
        "acceptance": (sampled - sum(rejected.values())) / sampled if sampled else 0.0,
        "rejected": {reason: rejected[reason] for reason in REASONS},
        "tokens": tokens,
        "seconds": round(seconds, 1),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
    }
    prompts = [ChatPrompt(SELF_KIND, "target", text) for text in accepted]
    return prompts, stats


def split(total: int, parts: int) -> list[int]:
    """`total` in `parts` near-equal whole parts, the larger first (zeros dropped by callers)."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def cached_self_prompts(
    target_dir: Path | str,
    count: int,
    cache: Path | str,
    seed: int = 0,
    batch: int = 64,
) -> list[ChatPrompt]:
    """`sample_self_prompts`, kept in the JSON file `cache`: a file written for the same count,
    seed and settings is read back instead of sampling; one written for others is an error
    (its messages may already be answered in chunk files: delete both to resample)."""
    cache = Path(cache)
    key = {
        "count": count, "seed": seed, "max_new_tokens": MAX_MESSAGE_TOKENS,
        "temperatures": list(TEMPERATURES), "top_p": TOP_P, "min_words": MIN_WORDS,
    }  # fmt: skip
    if cache.is_file():
        data = json.loads(cache.read_text())
        if data["settings"] != key:
            raise ValueError(
                f"{cache} holds self prompts sampled with {data['settings']}, not {key}: delete it "
                f"and the chunk_self_* files next to it to resample"
            )
        return [ChatPrompt(SELF_KIND, "target", message) for message in data["messages"]]
    settings = dataclasses.replace(MESSAGE_SETTINGS, batch=batch)
    prompts, stats = sample_self_prompts(target_dir, count, seed, settings)
    print(f"self prompts: {json.dumps(stats)}", file=sys.stderr)
    data = {
        "settings": key,
        "stats": stats | {"batch": batch},
        "messages": [p.message for p in prompts],
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_suffix(".partial")
    partial.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    os.replace(partial, cache)
    return prompts
