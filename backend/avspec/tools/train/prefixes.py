"""Prefixes of corpus text, the prompts a model continues: code from a line, prose from a
sentence or clause, 64..200 UTF-8 bytes (varied with the index, never split inside a character),
picked at evenly spaced indices (no randomness). The benchmark workloads draw them from the
held-out split (`avspec.tools.bench.workloads`), the draft's raw training prompts from the train
split (`avspec.tools.train.draft.prompts.build_raw_prompts`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

MIN_BYTES, MAX_BYTES = 64, 200


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
