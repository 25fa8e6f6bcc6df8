"""Chat prompts for draft training, built from the project's own corpus (no downloads).

The corpus is `avspec.tools.train.tiny.corpus`: the standard library's top-level modules (code)
and the pydoc topics (English prose), split by a hash of the file name. Train prompts come from
the train split, held-out prompts from the held-out split, so held-out acceptance is measured on
text the draft never saw. Kinds, in equal shares (what a chat user asks a small instruct model):

- `explain`: explain a function's source;
- `write`: write a function named as in the library, from its docstring's first line;
- `continue_code`: continue the first lines of a function;
- `question`: a question about a pydoc topic ("What does the Python `with` statement do?");
- `continue_prose`: continue the first sentences of a pydoc paragraph;
- `summarize`: summarize a pydoc paragraph.

A seventh kind, `self` (SELF_KIND), is not built here: user messages the target writes itself
(`avspec.tools.train.draft.self_prompts`), general chat the corpus lacks.

Each prompt is one user message; the target's chat template renders it (with its default
system line) in `avspec.tools.train.draft.generate`. The raw kinds (`RAW_KINDS`,
`build_raw_prompts`) are not messages: a prefix of a code file or of prose, which the target
continues as a completion with no template, as a raw prompt is served (the benchmark's code
workload).
"""

from __future__ import annotations

import ast
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from avspec.tools.train.prefixes import code_prompts, prose_prompts
from avspec.tools.train.tiny.corpus import TOPICS_PREFIX

KINDS = ("explain", "write", "continue_code", "question", "continue_prose", "summarize")
SELF_KIND = "self"  # target-written messages (`self_prompts`); not one of the corpus KINDS
RAW_KINDS = ("raw_code", "raw_prose")  # completions of raw text, no chat template
MAX_CODE_LINES = 24
MAX_PARAGRAPH_CHARS = 700


@dataclass(frozen=True)
class ChatPrompt:
    """One user message and what it was built from."""

    kind: str
    source: str
    message: str


def _functions(name: str, text: str) -> list[tuple[str, str, str | None]]:
    """(function name, source, docstring's first line) of each function in a module."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines()
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno:
            source = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            doc = ast.get_docstring(node)
            first = doc.strip().splitlines()[0].strip() if doc and doc.strip() else None
            if node.end_lineno - node.lineno >= 2 and len(source) < 4000:
                found.append((node.name, _dedent(source), first))
    return found


def _dedent(source: str) -> str:
    lines = source.splitlines()
    indent = min((len(s) - len(s.lstrip()) for s in lines if s.strip()), default=0)
    return "\n".join(s[indent:] for s in lines)


def _paragraphs(text: str) -> list[str]:
    """Prose paragraphs of a pydoc topic: blank-line separated, mostly letters, not code."""
    found = []
    for block in re.split(r"\n\s*\n", text):
        flat = " ".join(line.strip() for line in block.splitlines())
        if len(flat) >= 120 and not block.startswith(" ") and flat.count(" ") > 15:
            found.append(flat[:MAX_PARAGRAPH_CHARS])
    return found


def _first_sentences(paragraph: str, count: int) -> str:
    sentences = re.split(r"(?<=[.!?])\s+", paragraph)
    return " ".join(sentences[:count])


def _topic_title(text: str) -> str | None:
    first = text.strip().splitlines()[0].strip() if text.strip() else ""
    return first if 2 <= len(first) <= 60 else None


def build_prompts(files: Sequence[tuple[str, str]], count: int, seed: int) -> list[ChatPrompt]:
    """`count` prompts (kinds in turn, sources drawn with `seed`) from (name, text) files."""
    rng = random.Random(seed)
    functions, paragraphs, topics = [], [], []
    for name, text in files:
        if name.startswith(TOPICS_PREFIX):
            paragraphs += [(name, p) for p in _paragraphs(text)]
            title = _topic_title(text)
            if title is not None:
                topics.append((name, title))
        else:
            functions += [(name, *f) for f in _functions(name, text)]
    documented = [f for f in functions if f[3] is not None and len(f[3]) > 15]
    prompts = []
    for i in range(count):
        kind = KINDS[i % len(KINDS)]
        if kind in ("explain", "continue_code"):
            source, fname, code, _ = rng.choice(functions)
            lines = code.splitlines()
            if kind == "explain":
                body = "\n".join(lines[:MAX_CODE_LINES])
                message = f"Explain what this Python function does:\n\n```python\n{body}\n```"
            else:
                keep = rng.randint(2, min(8, len(lines)))
                body = "\n".join(lines[:keep])
                message = f"Continue this Python code:\n\n```python\n{body}\n```"
        elif kind == "write":
            source, fname, _, doc = rng.choice(documented)
            message = f"Write a Python function `{fname}`: {doc}"
        elif kind == "question":
            source, title = rng.choice(topics)
            template = rng.choice(
                (
                    "What does {} mean in Python?",
                    "Explain {} in Python in a few sentences.",
                    "How do I use {} in Python? Give a short example.",
                )
            )
            message = template.format(title.rstrip(":").lower())
        elif kind == "continue_prose":
            source, paragraph = rng.choice(paragraphs)
            message = f"Continue the following text:\n\n{_first_sentences(paragraph, 2)}"
        else:
            source, paragraph = rng.choice(paragraphs)
            message = f"Summarize this paragraph in one sentence:\n\n{paragraph}"
        prompts.append(ChatPrompt(kind, source, message))
    return prompts


def build_raw_prompts(files: Sequence[tuple[str, str]], count: int) -> list[ChatPrompt]:
    """`count` raw completion prompts from (name, text) files, kinds in turn: `raw_code`, a
    prefix of a code file starting at a line, and `raw_prose`, a prose paragraph from a sentence
    or clause, each 64-200 bytes, picked evenly as the benchmark workloads are
    (`avspec.tools.bench.workloads`, which draws its own from the held-out split only)."""
    code = [f for f in files if not f[0].startswith(TOPICS_PREFIX)]
    prose = [f for f in files if f[0].startswith(TOPICS_PREFIX)]
    texts = {
        "raw_code": code_prompts(code, (count + 1) // 2),
        "raw_prose": prose_prompts(prose, count // 2),
    }
    prompts = []
    for i in range(count):
        kind = RAW_KINDS[i % 2]
        if i // 2 < len(texts[kind]):
            prompts.append(ChatPrompt(kind, "corpus", texts[kind][i // 2]))
    return prompts
