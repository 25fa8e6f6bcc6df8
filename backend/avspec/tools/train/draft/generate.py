"""The target answers the chat prompts; its top-64 logits on each answer are kept for distillation.

Generation runs on the project's own runtime (`avspec.runtime`, the target's Hugging Face
directory in the served default precision, `avspec.runtime.precision.auto_dtype`: bf16 where
the CPU multiplies it natively, else float32) with continuous batching over its ragged KV
cache: up to `batch` sequences decode together, and a finished one (EOS or `max_new_tokens`)
frees its slot for the next prompt, prefilled in a separate call, so no row idles on padding
(measured here: `transformers.generate` with left padding, 1 thread, batch 32: 42 answer
tokens/s). Prompts are rendered by the target's chat template (`transformers`' Jinja renderer
on the target's `tokenizer_config.json`) and answered at temperature 0.7, top-p 0.95 (the
served setting). The raw logits of each decoding step are the target's distribution at that
answer position: their top `keep` (64) values and ids are saved, the distillation target, with
no second pass. Raw completion prompts (`RAW_KINDS`) are tokenized as they are, with no template.

Prompts are answered a chunk at a time; each chunk is one file `chunk_<index>.pt` (or another
prefix: `chunk_self_<index>.pt` for the self prompts, `chunk_raw_<index>.pt` for the raw ones)
written under a temporary name then renamed, so an interrupted run resumes at the first missing
chunk. A chunk holds per sequence: `prompt` (int32 ids), `answer` (int32 ids, through the EOS if one
came), `top_ids` [len(answer), keep] int32, `top_logits` [len(answer), keep] float16, and the
prompt kinds. With `AnswerSettings.features` it also holds `features` [len(prompt) +
len(answer) - 1, width] float16: the target's last hidden state after its final norm at every
position it read (the prompt, then each answer token but the last), the input a drafter that
reads the target learns from (`avspec.tools.train.head`); row j is what the target computed
from token j when it chose token j + 1.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.precision import auto_dtype
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.prompts import RAW_KINDS, ChatPrompt
from avspec.tools.train.tiny.evaluate import warp

MAX_PROMPT_TOKENS = 384


@dataclass(frozen=True)
class AnswerSettings:
    """How the target answers: `batch` rows decode together, at most `max_new_tokens` tokens,
    sampled at `temperature` / `top_p` (0 is greedy), the top `keep` logits kept per token, and
    (`features`) the target's last hidden states kept too."""

    batch: int = 64
    max_new_tokens: int = 128
    temperature: float = 0.7
    top_p: float = 0.95
    keep: int = 64
    features: bool = False


DEFAULT_ANSWERS = AnswerSettings()


def chat_renderer(target_dir: Path | str) -> Any:
    """The target's `transformers` tokenizer: its `apply_chat_template` renders prompts."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(target_dir))


def render(tokenizer: Any, prompt: ChatPrompt) -> list[int]:
    """Token ids of `prompt` in the chat template, ready for the assistant's answer (the
    message body cut so the whole prompt fits MAX_PROMPT_TOKENS); a raw kind's text as it is
    (`RAW_KINDS`: no template, no special tokens, the last MAX_PROMPT_TOKENS ids)."""
    message = prompt.message
    if prompt.kind in RAW_KINDS:
        return list(tokenizer(message, add_special_tokens=False)["input_ids"])[-MAX_PROMPT_TOKENS:]
    while True:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=True
        )
        if len(ids) <= MAX_PROMPT_TOKENS:
            return list(ids)
        message = message[: int(len(message) * 0.8)]


@torch.no_grad()
def answer_all(
    model: Transformer,
    prompts: Sequence[list[int]],
    eos_ids: frozenset[int],
    settings: AnswerSettings,
    generator: torch.Generator,
    on_token: Callable[[int], None] | None = None,
) -> list[dict[str, torch.Tensor]]:
    """Sample an answer to every token-id prompt, continuously batched; per prompt a dict of
    `answer`, `top_ids`, `top_logits` and, with `settings.features`, `features` (see the module
    docstring)."""
    batch, keep = settings.batch, settings.keep
    cache = model.new_cache(batch, MAX_PROMPT_TOKENS + settings.max_new_tokens)
    queue = list(range(len(prompts)))[::-1]  # pop() takes them in order
    free = list(range(batch))[::-1]
    live: dict[int, dict[str, Any]] = {}  # slot -> state
    results: list[dict[str, torch.Tensor]] = [{} for _ in prompts]
    while queue or live:
        new = []
        while queue and free:
            slot, index = free.pop(), queue.pop()
            cache.allocate(slot)
            live[slot] = {"index": index, "answer": [], "ids": [], "logits": [], "features": []}
            new.append(slot)
        steps = []
        if new:  # prefill the newcomers on their own: decode rows need no query padding
            lengths = [len(prompts[live[s]["index"]]) for s in new]
            flat = torch.tensor([t for s in new for t in prompts[live[s]["index"]]])
            ends = torch.tensor(lengths).cumsum(0) - 1
            if settings.features:
                hidden = model.forward_cached(cache, new, flat, lengths, hidden=True)
                normed = model.final_norm(hidden).to(torch.float16)
                for slot, piece in zip(new, normed.split(lengths), strict=True):
                    live[slot]["features"].append(piece)
                steps.append((new, model.logits(hidden[ends])))
            else:
                steps.append((new, model.forward_cached(cache, new, flat, lengths, at=ends)))
        decoding = [s for s in live if s not in new]
        if decoding:
            last = torch.tensor([live[s]["answer"][-1] for s in decoding])
            ones = [1] * len(last)
            if settings.features:
                hidden = model.forward_cached(cache, decoding, last, ones, hidden=True)
                normed = model.final_norm(hidden).to(torch.float16)
                for row, slot in enumerate(decoding):
                    live[slot]["features"].append(normed[row : row + 1])
                steps.append((decoding, model.logits(hidden)))
            else:
                steps.append((decoding, model.forward_cached(cache, decoding, last, ones)))
        for slots, logits in steps:
            logits = logits.float()
            values, ids = logits.topk(keep, dim=-1)
            probs = warp(logits, settings.temperature, settings.top_p)
            tokens = torch.multinomial(probs, 1, generator=generator)[:, 0].tolist()
            for row, slot in enumerate(slots):
                state = live[slot]
                state["answer"].append(tokens[row])
                state["ids"].append(ids[row].to(torch.int32))
                state["logits"].append(values[row].to(torch.float16))
                if tokens[row] in eos_ids or len(state["answer"]) >= settings.max_new_tokens:
                    results[state["index"]] = finished(state, settings.features)
                    del live[slot]
                    cache.free(slot)
                    free.append(slot)
            if on_token is not None:
                on_token(len(slots))
    return results


def finished(state: dict[str, Any], features: bool) -> dict[str, torch.Tensor]:
    """A finished answer's tensors (see the module docstring)."""
    result = {
        "answer": torch.tensor(state["answer"], dtype=torch.int32),
        "top_ids": torch.stack(state["ids"]),
        "top_logits": torch.stack(state["logits"]),
    }
    if features:
        result["features"] = torch.cat(state["features"])
    return result


def chunk_path(out_dir: Path, index: int, prefix: str = "chunk_") -> Path:
    """The file of chunk `index`."""
    return out_dir / f"{prefix}{index:05d}.pt"


def generate_chunks(
    target_dir: Path | str,
    prompts: Sequence[ChatPrompt],
    out_dir: Path | str,
    settings: AnswerSettings = DEFAULT_ANSWERS,
    seed: int = 0,
    prefix: str = "chunk_",
    chunk_size: int = 256,
) -> list[Path]:
    """Answer `prompts` a chunk at a time into `out_dir` (resumable); returns the chunk files.

    Chunk i is sampled with seed `seed + i`, so a resumed run draws what an uninterrupted one
    would have. Its file is `<prefix><i:05d>.pt`: another prefix starting with "chunk_" (the
    self prompts' "chunk_self_") keeps a second series apart in the same directory.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    count = (len(prompts) + chunk_size - 1) // chunk_size
    paths = [chunk_path(out_dir, i, prefix) for i in range(count)]
    todo = [i for i, p in enumerate(paths) if not p.is_file()]
    if not todo:
        return paths
    renderer = chat_renderer(target_dir)
    eos = load_tokenizer(target_dir).eos_ids
    max_new_tokens = settings.max_new_tokens
    context = MAX_PROMPT_TOKENS + max_new_tokens
    model = load_model(target_dir, dtype=auto_dtype(), max_length=context)
    start, done = time.perf_counter(), 0
    total = sum(min(chunk_size, len(prompts) - i * chunk_size) for i in todo) * max_new_tokens
    bar = tqdm(total=total, desc="target answers (token slots)", file=sys.stderr, mininterval=10.0)

    def on_token(n: int) -> None:
        nonlocal done
        done += n
        bar.update(n)
        bar.set_postfix(tokens_per_s=f"{done / (time.perf_counter() - start):.0f}", refresh=False)

    for index in todo:
        chunk_prompts = list(prompts[index * chunk_size : (index + 1) * chunk_size])
        ids = [render(renderer, p) for p in chunk_prompts]
        generator = torch.Generator().manual_seed(seed + index)
        answers = answer_all(model, ids, eos, settings, generator, on_token)
        bar.update(len(ids) * max_new_tokens - sum(len(a["answer"]) for a in answers))
        chunk = {
            "kinds": [p.kind for p in chunk_prompts],
            "prompt": [torch.tensor(p, dtype=torch.int32) for p in ids],
            **{key: [a[key] for a in answers] for key in answers[0]},
        }
        partial = paths[index].with_suffix(".partial")
        torch.save(chunk, partial)
        os.replace(partial, paths[index])
    bar.close()
    return paths
