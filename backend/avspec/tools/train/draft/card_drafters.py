"""The model card's section on both drafters side by side: the draft model and the draft head.

Same contexts for both: the first `count` prompts of each workload file (`workloads/chat.jsonl`,
`code.jsonl`, `general.jsonl`, the last a source held out of every training set), answered by
the target (up to ANSWER_TOKENS tokens, temperature 0.7 / top-p 0.95); each context is a prompt
plus a uniformly drawn share of its answer. Each drafter drafts DEPTH tokens from it
autoregressively (`evaluate.draft_chains`; the head through `head.drafter.HeadDrafter`, reading
the target's features of the context as served) at each setting of WARPS: acceptance by
position, and at the served 0.7 / 0.95 the calibration of logit(q_max) (`card_measure.
calibration`: AUC, the fitted slope and intercepts, fitted ECE on the other half). The cost of a
draft pass at 1 and 64 rows comes from each pair's cost-tables file (`card_cost`).

`measure_drafters` returns plain data; `render_drafters` writes the section's lines.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from avspec.engine.draft_vocab import DRAFT_VOCAB_AUTO, resolve_draft_vocab
from avspec.runtime.head import load_head
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.card_cost import cost_section
from avspec.tools.train.draft.card_measure import (
    ANSWER_TOKENS,
    DEPTH,
    acceptance_table,
    calibration,
)
from avspec.tools.train.draft.evaluate import draft_chains, served_draft
from avspec.tools.train.draft.generate import AnswerSettings, answer_all
from avspec.tools.train.head.drafter import HeadDrafter

WORKLOADS = ("chat", "code", "general")
WORKLOAD_DIR = Path(__file__).resolve().parents[5] / "workloads"  # the repository's
WARPS = {"0.7": (0.7, 0.95), "greedy": (0.0, 1.0)}
SERVED = "0.7"
COUNT = 64  # prompts per workload
DRAFTERS = ("draft model", "head")


def workload_sequences(
    target: Transformer, tokenizer: Any, path: Path, count: int, seed: int
) -> list[dict]:
    """The target's sampled answers to the first `count` prompts of a workload file (text as
    served: chat prompts already in the template), as `evaluate.load_chunks` gives sequences."""
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    ids = [tokenizer.encode(row["prompt"]) for row in lines[:count]]
    settings = AnswerSettings(min(64, len(ids)), ANSWER_TOKENS, *WARPS[SERVED], keep=1)
    answers = answer_all(target, ids, tokenizer.eos_ids, settings,
                         torch.Generator().manual_seed(seed))  # fmt: skip
    return [
        {"ids": torch.cat([torch.tensor(p), a["answer"].long()[:-1]]), "prompt_length": len(p),
         "answer_length": len(a["answer"])}
        for p, a in zip(ids, answers, strict=True) if len(a["answer"])
    ]  # fmt: skip


def drafters(
    target: Transformer, draft: Transformer, draft_dir: Path, head_dir: Path
) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """Both drafters as served: over their draft vocabularies, the head in the target's dtype."""
    dtype = target.embed.weight.dtype
    draft_vocab = resolve_draft_vocab(draft_dir, DRAFT_VOCAB_AUTO, draft.config.vocab_size)
    head, _ = load_head(head_dir, target, dtype)
    head_vocab = resolve_draft_vocab(head_dir, DRAFT_VOCAB_AUTO, target.config.vocab_size)
    kept = None if head_vocab is None else torch.tensor(head_vocab.token_ids)
    return {"draft model": served_draft(draft, draft_vocab),
            "head": HeadDrafter(head, target, kept)}  # fmt: skip


def measure_drafters(
    target: Transformer, tokenizer: Any, models: dict[str, Callable], paths: dict[str, Path],
    count: int = COUNT, seed: int = 0,
) -> dict[str, Any]:  # fmt: skip
    """Every figure of the section. `models`: `drafters`' callables; `paths`: the workload
    directory (`workloads`), the pair directories (`target`, `draft`, `head`) and each drafter's
    cost file (`draft_costs`, `head_costs`; absent: not reported)."""
    section: dict[str, Any] = {"count": count, "depth": DEPTH, "workloads": {}, "cost": {}}
    for workload in WORKLOADS:
        sequences = workload_sequences(
            target, tokenizer, paths["workloads"] / f"{workload}.jsonl", count, seed
        )
        entry: dict[str, Any] = {"contexts": len(sequences)}
        for name, model in models.items():
            for warp, setting in WARPS.items():
                chains = draft_chains(model, target, sequences, DEPTH, 1, seed, setting)
                entry[f"{name} {warp}"] = acceptance_table(chains)
                if warp == SERVED:
                    entry[f"{name} calibration"] = calibration(chains, seed + 1)
        section["workloads"][workload] = entry
    for name, key in (("draft model", "draft"), ("head", "head")):
        file = paths.get(f"{key}_costs")
        if file is not None and Path(file).is_file():
            section["cost"][name] = cost_section(file, paths["target"], paths[key])
    return section


def render_drafters(section: dict[str, Any]) -> list[str]:
    """The section's Markdown lines."""
    lines = [
        "## The draft head beside the draft model",
        "",
        f"Same contexts for both: the first {section['count']} prompts of each workload "
        "(`workloads/<name>.jsonl`; `general` is 64 everyday questions of a source held out of "
        "every training set), answered by the target, cut at a uniformly drawn share of the "
        f"answer. Each drafter drafts {section['depth']} tokens autoregressively; the head reads "
        "the target's features of the context and then its own guesses, as served "
        "(`avspec.tools.train.head.drafter`). Acceptance is sum_v min(p, q) at each position "
        "(greedy: whether the two argmaxes agree), drafts sampled from the drafter's q.",
        "",
    ]
    for warp, title in (("0.7", "temperature 0.7 / top-p 0.95"), ("greedy", "greedy")):
        lines += _acceptance(section["workloads"], warp, title)
    lines += _calibration(section["workloads"])
    lines += _costs(section["cost"])
    return lines


def _acceptance(workloads: dict[str, Any], warp: str, title: str) -> list[str]:
    names = list(workloads)
    columns = [workloads[w][f"{d} {warp}"] for w in names for d in DRAFTERS]
    header = " | ".join(f"{w} {d}" for w in names for d in DRAFTERS)
    lines = [f"Acceptance by position, {title}:", "", f"| position | {header} |",
             "|---" * (1 + len(columns)) + "|"]  # fmt: skip
    for k in range(len(columns[0])):
        cells = " | ".join(f"{column[k]['acceptance']:.3f}" for column in columns)
        lines.append(f"| {k + 1} | {cells} |")
    contexts = ", ".join(f"{w} {workloads[w]['contexts']}" for w in names)
    se = max(row["se"] for column in columns for row in column)
    return [*lines, "", f"Contexts: {contexts}; the largest standard error {se:.3f}.", ""]


def _calibration(workloads: dict[str, Any]) -> list[str]:
    lines = [
        "logit(q_max) at temperature 0.7 / top-p 0.95: soft AUC over positions 1-8, and the "
        "served estimator sigmoid(w f + b_k) fitted on the even contexts' sampled labels, its "
        "ECE on the odd ones beside the ECE a perfectly calibrated estimator would show from "
        "sampling alone at that label count:",
        "",
        "| workload | drafter | AUC | w | b_1 / b_2 / b_3 | labels | fitted ECE | noise floor |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for w, entry in workloads.items():
        for d in DRAFTERS:
            c = entry[f"{d} calibration"]
            b = " / ".join("-" if math.isnan(x) else f"{x:.2f}" for x in c["intercepts"][:3])
            lines.append(
                f"| {w} | {d} | {c['auc_soft_served_all']:.3f} | {c['slope']:.3f} | {b} | "
                f"{c['eval_labels']} | {c['ece']:.3f} | {c['ece_noise_mean']:.3f} |"
            )
    return [*lines, ""]


def _costs(costs: dict[str, Any]) -> list[str]:
    lines = ["A draft pass against a target step of one token per row, from each pair's cost file:",
             "", "| drafter | rows | draft pass ms | target step ms | pass / step | file |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, cost in costs.items():
        if not cost["this_pair"]:
            lines.append(f"| {name} | - | - | - | - | `{cost['file']}`: {cost['why']} |")
            continue
        for r in cost["rows"]:
            lines.append(
                f"| {name} | {r['rows']} | {r['draft_pass_ms']:.2f} | {r['target_step_ms']:.2f} "
                f"| {1 / r['ratio']:.3f} | `{cost['file']}` ({cost['provenance']['date']}) |"
            )
    if not costs:
        lines.append("| - | - | - | - | - | no cost file given |")
    return [*lines, ""]
