"""Build the benchmark prompt sets from the held-out split of the training corpus.

Three workloads with different draft/target agreement, `PROMPTS_PER_SET` prompts each, written
as JSONL lines `{"prompt": ..., "workload": ...}`:

- `code`: Python source prefixes starting at a line of held-out standard-library modules;
- `prose`: English from held-out `pydoc_data/topics.py` topics (paragraphs reflowed onto one
  line), starting at a sentence or clause;
- `high_entropy`: text that ends inside a line dense with numbers, hex, or string literals,
  so the continuation is data the draft cannot guess.

Prompts are 64..200 UTF-8 bytes, never split inside a character, chosen by evenly spaced
indices (no randomness), so the sets are a pure function of the Python version's stdlib.

    python -m avspec.tools.workloads --out workloads
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence
from pathlib import Path

from avspec.tools.training.corpus import TOPICS_PREFIX, corpus_files, split_files

PROMPTS_PER_SET = 256
MIN_BYTES, MAX_BYTES = 64, 200
WORKLOADS = ("code", "prose", "high_entropy")

_LITERAL = re.compile(r"0[xXoObB][0-9a-fA-F_]+|\d+(?:\.\d+)?|'[^']{4,}'|\"[^\"]{4,}\"")


def target_bytes(index: int) -> int:
    """Deterministic prompt length in MIN_BYTES..MAX_BYTES, varied with the index."""
    return MIN_BYTES + (index * 37) % (MAX_BYTES - MIN_BYTES + 1)


def fit(text: str, limit: int, prefer: str = "") -> str:
    """Longest prefix of `text` within `limit` UTF-8 bytes, ending after the last `prefer`
    character if that still leaves at least MIN_BYTES."""
    prefix = text.encode("utf-8")[:limit].decode("utf-8", errors="ignore")
    if prefer:
        cut = max(prefix.rfind(c) for c in prefer) + 1
        if len(prefix[:cut].encode("utf-8")) >= MIN_BYTES:
            return prefix[:cut]
    return prefix


def even_pick(candidates: Sequence, count: int) -> list:
    """`count` evenly spaced items of `candidates` (all of them if there are fewer)."""
    if len(candidates) <= count:
        return list(candidates)
    return [candidates[i * len(candidates) // count] for i in range(count)]


def code_prompts(files: Sequence[tuple[str, str]], count: int) -> list[str]:
    """Prefixes starting at non-blank lines of code files, cut after a whole line if possible."""
    starts = []
    for _, text in files:
        offset = 0
        for line in text.splitlines(keepends=True):
            if line.strip() and len(text[offset:].encode("utf-8")) >= MAX_BYTES:
                starts.append((text, offset))
            offset += len(line)
    picked = even_pick(starts, count)
    return [fit(text[o:], target_bytes(i), "\n") for i, (text, o) in enumerate(picked)]


def prose_prompts(files: Sequence[tuple[str, str]], count: int) -> list[str]:
    """Prefixes starting at a sentence or clause of prose paragraphs, cut after a word."""
    starts = []
    for _, text in files:
        for para in re.split(r"\n\s*\n", text):
            body = " ".join(para.split())  # reflow: one paragraph, single spaces
            letters = sum(c.isalpha() or c.isspace() for c in body)
            if not body[:1].isalpha() or letters < 0.8 * len(body) or "::=" in body:
                continue
            for clause in re.finditer(r"(?:^|(?<=[.;,:] ))[A-Za-z]", body):
                if len(body[clause.start() :].encode("utf-8")) >= MIN_BYTES:
                    starts.append(body[clause.start() :])
    picked = even_pick(starts, count)
    return [fit(text, target_bytes(i), " ") for i, text in enumerate(picked)]


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


def build_workloads(count: int = PROMPTS_PER_SET) -> dict[str, list[str]]:
    """The three prompt sets, from the held-out split only."""
    _, held_out = split_files(corpus_files())
    code = [f for f in held_out if not f[0].startswith(TOPICS_PREFIX)]
    prose = [f for f in held_out if f[0].startswith(TOPICS_PREFIX)]
    sets = {
        "code": code_prompts(code, count),
        "prose": prose_prompts(prose, count),
        "high_entropy": high_entropy_prompts(code, count),
    }
    for name, prompts in sets.items():
        if len(prompts) < count:
            raise ValueError(f"workload {name}: only {len(prompts)} prompts, need {count}")
    return sets


def write_workloads(out: Path, sets: dict[str, list[str]]) -> None:
    """Write `<out>/<workload>.jsonl`, one {"prompt", "workload"} object per line."""
    out.mkdir(parents=True, exist_ok=True)
    for name, prompts in sets.items():
        lines = [json.dumps({"prompt": p, "workload": name}, ensure_ascii=False) for p in prompts]
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the code/prose/high_entropy prompt sets.")
    parser.add_argument("--out", type=Path, default=Path("workloads"), help="output directory")
    parser.add_argument("--count", type=int, default=PROMPTS_PER_SET, help="prompts per set")
    args = parser.parse_args(argv)
    write_workloads(args.out, build_workloads(args.count))


if __name__ == "__main__":
    main()
