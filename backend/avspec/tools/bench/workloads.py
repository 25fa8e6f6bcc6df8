"""Build the benchmark prompt sets from the held-out split of the training corpus.

Three workloads with different draft/target agreement, `PROMPTS_PER_SET` prompts each, written
as JSONL lines `{"prompt": ..., "workload": ...}`, and a chat set for an instruct target:

- `code`: Python source prefixes starting at a line of held-out standard-library modules;
- `prose`: English from held-out `pydoc_data/topics.py` topics (paragraphs reflowed onto one
  line), starting at a sentence or clause;
- `high_entropy`: text that ends inside a line dense with numbers, hex, or string literals,
  so the continuation is data the draft cannot guess.

Prompts are 64..200 UTF-8 bytes, never split inside a character, chosen by evenly spaced
indices (no randomness), so the sets are a pure function of the Python version's stdlib.

- `chat` (only with `--chat-template-from DIR`): `CHAT_PROMPTS` questions and instructions
  built by the draft pipeline's prompt builder (`avspec.tools.train.draft.prompts.build_prompts`,
  its six kinds in turn, seed `CHAT_SEED`, no message twice, none over `MAX_PROMPT_TOKENS` tokens)
  and rendered by DIR's chat template (`avspec.tools.train.draft.generate.chat_renderer`): `prompt`
  is the whole templated text, ending with the assistant header; each line also keeps `kind`
  and `messages` (the user message). A function of the stdlib and the template.
- `general` (with `--chat-template-from DIR` too): the hand-written everyday questions of
  `avspec.tools.bench.general_chat` (facts, how-to, advice, writing, plans), rendered the same
  way: a source no drafter trains on.

    python -m avspec.tools.bench.workloads --out workloads --chat-template-from models/target
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from avspec.tools.train.prefixes import (
    code_prompts,
    even_pick,
    prose_prompts,
    target_bytes,
)
from avspec.tools.train.tiny.corpus import TOPICS_PREFIX, corpus_files, split_files

PROMPTS_PER_SET = 256
WORKLOADS = ("code", "prose", "high_entropy")
CHAT_WORKLOAD = "chat"
GENERAL_WORKLOAD = "general"  # hand-written everyday questions, never trained on
CHAT_PROMPTS = 64
CHAT_SEED = 0
CHAT_CANDIDATES = 4  # prompts built per chat prompt wanted, to skip repeats and long ones

_LITERAL = re.compile(r"0[xXoObB][0-9a-fA-F_]+|\d+(?:\.\d+)?|'[^']{4,}'|\"[^\"]{4,}\"")


def high_entropy_prompts(files: Sequence[tuple[str, str]], count: int) -> list[str]:
    """Context ending just before a literal (number, hex, long string) on a dense line."""
    cuts = []
    for _, text in files:
        offset = 0
        for line in text.splitlines(keepends=True):
            literals = list(_LITERAL.finditer(line))
            dense = sum(m.end() - m.start() for m in literals) >= 0.3 * len(line.strip())
            if line.strip() and not line.lstrip().startswith("#") and dense:
                cuts += [(text, offset + m.start()) for m in literals if offset + m.start() > 0]
            offset += len(line)
    prompts = []
    for i, (text, end) in enumerate(even_pick(cuts, count)):
        limit = target_bytes(i)
        data = text[:end].encode("utf-8")
        prompts.append(data[max(0, len(data) - limit) :].decode("utf-8", errors="ignore"))
    return prompts


def chat_prompts(
    files: Sequence[tuple[str, str]], count: int, renderer: Any, seed: int = CHAT_SEED
) -> list[dict[str, Any]]:
    """`count` chat prompts, kinds in turn: {"prompt" (the rendered text), "kind", "messages"}.

    Candidates come from `build_prompts` (CHAT_CANDIDATES per prompt); for each kind its next
    candidate is taken unless its message was taken before or its rendering has more than
    MAX_PROMPT_TOKENS tokens (the draft pipeline's bound)."""
    from avspec.tools.train.draft.generate import MAX_PROMPT_TOKENS
    from avspec.tools.train.draft.prompts import KINDS, build_prompts

    candidates = build_prompts(files, CHAT_CANDIDATES * count, seed)
    queues = {kind: [c for c in candidates if c.kind == kind] for kind in KINDS}
    seen: set[str] = set()
    rows = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        while True:
            if not queues[kind]:
                raise ValueError(f"workload chat: too few distinct {kind} prompts for {count}")
            candidate = queues[kind].pop(0)
            messages = [{"role": "user", "content": candidate.message}]
            ids = renderer.apply_chat_template(messages, add_generation_prompt=True)
            if candidate.message not in seen and len(ids) <= MAX_PROMPT_TOKENS:
                break
        seen.add(candidate.message)
        text = renderer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": text, "kind": kind, "messages": messages})
    return rows


def general_prompts(renderer: Any) -> list[dict[str, Any]]:
    """The `GENERAL_CHAT` questions rendered by `renderer`'s chat template, as `chat_prompts`."""
    from avspec.tools.bench.general_chat import GENERAL_CHAT

    rows = []
    for kind, question in GENERAL_CHAT:
        messages = [{"role": "user", "content": question}]
        text = renderer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        rows.append({"prompt": text, "kind": kind, "messages": messages})
    return rows


def build_workloads(
    count: int = PROMPTS_PER_SET,
    chat_template_from: Path | str | None = None,
    chat_count: int = CHAT_PROMPTS,
) -> dict[str, list]:
    """The three prompt sets, from the held-out split only; with `chat_template_from` (a model
    directory whose tokenizer config holds a chat template) also the chat set (`chat_prompts`)
    and the general set (`general_prompts`: a source held out of every drafter's training)."""
    _, held_out = split_files(corpus_files())
    code = [f for f in held_out if not f[0].startswith(TOPICS_PREFIX)]
    prose = [f for f in held_out if f[0].startswith(TOPICS_PREFIX)]
    sets: dict[str, list] = {
        "code": code_prompts(code, count),
        "prose": prose_prompts(prose, count),
        "high_entropy": high_entropy_prompts(code, count),
    }
    for name, prompts in sets.items():
        if len(prompts) < count:
            raise ValueError(f"workload {name}: only {len(prompts)} prompts, need {count}")
    if chat_template_from is not None:
        from avspec.tools.train.draft.generate import chat_renderer

        renderer = chat_renderer(chat_template_from)
        sets[CHAT_WORKLOAD] = chat_prompts(held_out, chat_count, renderer)
        sets[GENERAL_WORKLOAD] = general_prompts(renderer)
    return sets


def write_workloads(out: Path, sets: dict[str, list]) -> None:
    """Write `<out>/<workload>.jsonl`, one {"prompt", "workload", ...} object per line (a set's
    items are prompt strings, or dicts with "prompt" and more keys, kept after "workload")."""
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in sets.items():
        lines = []
        for p in prompts:
            extra = {} if isinstance(p, str) else {k: v for k, v in p.items() if k != "workload"}
            row = {"prompt": p if isinstance(p, str) else extra.pop("prompt"), "workload": name}
            lines.append(json.dumps(row | extra, ensure_ascii=False))
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description="Write the code/prose/high_entropy prompt sets (and the chat set)."
    )
    parser.add_argument("--out", type=Path, default=Path("workloads"), help="output directory")
    parser.add_argument("--count", type=int, default=PROMPTS_PER_SET, help="prompts per set")
    parser.add_argument(
        "--chat-template-from", type=Path, metavar="DIR",
        help="model directory whose chat template renders the chat set (without it, chat.jsonl "
        "is not rebuilt)",
    )  # fmt: skip
    parser.add_argument("--chat-count", type=int, default=CHAT_PROMPTS, help="chat prompts")
    args = parser.parse_args(argv)
    sets = build_workloads(args.count, args.chat_template_from, args.chat_count)
    write_workloads(args.out, sets)


if __name__ == "__main__":
    main()
