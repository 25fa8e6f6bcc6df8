"""The Markdown model card of a (target, draft) pair of Hugging Face directories, measured here.

    python -m avspec.tools.train.draft --only card --target models/target \\
        --out models/draft --card models/MODEL_CARD.md

Both models run in bf16 on the project's runtime (`avspec.runtime`), at the served sampling
setting (temperature 0.7, top-p 0.95). Sections:

- the pair: each model's source (a target converted from a GGUF names it, and whether it is the
  pinned one), shape, parameters, weights; the draft's training summary from its
  `training_report.json` when the directory holds one;
- acceptance by draft position 1..DEPTH: `contexts` chat prompts of the held-out split
  (`prompts.build_prompts`, seed `seed`) in the target's chat template (`generate.render`),
  answered by the target (`generate.answer_all`, up to ANSWER_TOKENS tokens); each context is
  a prompt plus a uniformly drawn share of its answer, from which the draft drafts DEPTH tokens
  autoregressively (`evaluate.draft_chains`). The entry at position k is the mean over contexts
  of sum_v min(p(v), q(v)), with its standard error over contexts;
- calibration: the AUC of logit(q_max) against acceptance, soft (expected over outcomes, no
  sampling noise) and against sampled verification labels; the served estimator's model
  (sigmoid(w f + b_k), f the served feature, `avspec.tools.train.features_zoo.fit_logistic`) fitted
  on the labels of the even contexts, and its reliability table and ECE on the odd ones;
- cost ratio: a target step against a draft pass over the same rows, from a cost-tables file
  (`avspec.av.cost_file`), only when the file was measured on this pair;
- greedy answers of both models to a few chat prompts;
- with `--card-head DIR`, a draft head beside the draft on the same workload contexts
  (`card_drafters`).

The card starts with the command that regenerates it (`card_command`).

Here: the command, `measure_card` and `write_card`, and `disagreements` (a rerun's acceptance
table against a card's). The figures are measured in `card_measure` (the pair, acceptance,
calibration, samples) and `card_cost` (the cost ratio, when the file is this pair's); the text
is `card_render`'s.
"""

from __future__ import annotations

import math
import platform
import shlex
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avspec.engine.draft_vocab import DRAFT_VOCAB_AUTO, resolve_draft_vocab
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.tools.train.draft.card_cost import cost_section
from avspec.tools.train.draft.card_drafters import WORKLOAD_DIR, drafters, measure_drafters
from avspec.tools.train.draft.card_measure import (
    ANSWER_TOKENS,
    CONTEXTS,
    DEPTH,
    DTYPE,
    SAMPLE_PROMPTS,
    SAMPLE_TOKENS,
    acceptance_table,
    calibration,
    chat_sequences,
    describe_model,
    greedy_samples,
)
from avspec.tools.train.draft.card_render import render_card
from avspec.tools.train.draft.evaluate import draft_chains, served_draft
from avspec.tools.train.draft.generate import MAX_PROMPT_TOKENS, chat_renderer
from avspec.tools.train.draft.prompts import build_prompts
from avspec.tools.train.tiny.corpus import corpus_files, split_files


def card_command(
    target: Path | str,
    draft: Path | str,
    card: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    threads: int = 1,
    cost_tables: Path | str | None = None,
    head: Path | str | None = None,
) -> str:
    """The shell command that regenerates a card (`python -m avspec.tools.train.draft
    --only card`)."""
    parts = ["python", "-m", "avspec.tools.train.draft", "--only", "card", "--target", str(target)]
    parts += ["--out", str(draft), "--card", str(card), "--card-contexts", str(contexts)]
    parts += ["--seed", str(seed), "--threads", str(threads)]
    if cost_tables is not None:
        parts += ["--cost-tables", str(cost_tables)]
    if head is not None:
        parts += ["--card-head", str(head)]
    return shlex.join(parts)


def measure_card(
    target_dir: Path | str,
    draft_dir: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    cost_tables: Path | str | None = None,
    head: Path | str | None = None,
) -> dict[str, Any]:
    """Every figure of the card (plain data; `render_card` writes it). With `head` (a draft
    head's directory, its cost file `cost_tables.json` beside it) the card also sets it beside
    the draft (`card_drafters`)."""
    begin = time.perf_counter()
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    # The cost file first: a malformed one fails before minutes of measuring.
    cost = None if cost_tables is None else cost_section(cost_tables, target_dir, draft_dir)
    max_length = MAX_PROMPT_TOKENS + max(ANSWER_TOKENS, SAMPLE_TOKENS) + DEPTH
    target = load_model(target_dir, dtype=DTYPE, max_length=max_length)
    draft = load_model(draft_dir, dtype=DTYPE, max_length=max_length)
    vocab = resolve_draft_vocab(draft_dir, DRAFT_VOCAB_AUTO, draft.config.vocab_size)
    renderer = chat_renderer(target_dir)
    tokenizer = load_tokenizer(target_dir)
    _, held_out = split_files(corpus_files())
    prompts = build_prompts(held_out, contexts, seed)
    sequences = chat_sequences(target, renderer, tokenizer.eos_ids, prompts, seed)
    chains = draft_chains(served_draft(draft, vocab), target, sequences, DEPTH, 1, seed)
    same_tokenizer = (target_dir / "tokenizer.json").read_bytes() == (
        draft_dir / "tokenizer.json"
    ).read_bytes()
    card: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)",
        "target": describe_model(target_dir, target),
        "draft": describe_model(draft_dir, draft),
        "same_tokenizer": same_tokenizer,
        "contexts": contexts,
        "draft_vocab": None if vocab is None else len(vocab.token_ids),
        "seed": seed,
        "kinds": sorted({p.kind for p in prompts}),
        "mean_prompt_tokens": float(np.mean([s["prompt_length"] for s in sequences])),
        "mean_answer_tokens": float(np.mean([s["answer_length"] for s in sequences])),
        "acceptance": acceptance_table(chains),
        "calibration": calibration(chains, seed + 1),
        "samples": {
            "prompts": list(SAMPLE_PROMPTS),
            **greedy_samples(
                {"target": target, "draft": draft}, renderer, tokenizer, SAMPLE_PROMPTS
            ),
        },
    }
    if cost is not None:
        card["cost"] = cost
    if head is not None:
        head = Path(head)
        paths = {"workloads": WORKLOAD_DIR, "target": target_dir, "draft": draft_dir, "head": head,
                 "head_costs": head / "cost_tables.json"}  # fmt: skip
        if cost_tables is not None:
            paths["draft_costs"] = Path(cost_tables)
        models = drafters(target, draft, draft_dir, head)
        card["drafters"] = measure_drafters(target, tokenizer, models, paths, seed=seed)
    card["seconds"] = time.perf_counter() - begin
    return card


def write_card(
    target_dir: Path | str,
    draft_dir: Path | str,
    out: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    cost_tables: Path | str | None = None,
    threads: int = 1,
    head: Path | str | None = None,
) -> dict[str, Any]:
    """Measure the pair (and `head` beside it) and write its card to `out`; returns the
    measurements."""
    card = measure_card(target_dir, draft_dir, contexts, seed, cost_tables, head)
    command = card_command(target_dir, draft_dir, out, contexts, seed, threads, cost_tables, head)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_card(card, command), encoding="utf-8")
    return card


def disagreements(
    card: Sequence[dict[str, Any]], rerun: Sequence[dict[str, Any]], sigmas: float = 4.0
) -> list[int]:
    """Positions where two acceptance tables differ by more than `sigmas` combined standard
    errors (sqrt(se_a^2 + se_b^2)); a position missing from either table counts as one."""
    by_position = {r["position"]: r for r in rerun}
    bad: list[int] = []
    for row in card:
        other = by_position.get(row["position"])
        if other is None:
            bad.append(row["position"])
            continue
        bound = sigmas * math.hypot(row["se"], other["se"])
        if not abs(row["acceptance"] - other["acceptance"]) <= bound:
            bad.append(row["position"])
    return bad + sorted(set(by_position) - {r["position"] for r in card})
