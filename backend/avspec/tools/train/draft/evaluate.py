"""Held-out measures of a draft: acceptance at position 1 and how well logit(q_max) ranks it.

Acceptance of one position is the expected acceptance of speculative sampling,
sum_v min(p(v), q(v)), with p the target's and q the draft's distribution both warped as
served (temperature 0.7, top-p 0.95; `avspec.tools.train.tiny.evaluate.warp`). "Position 1"
means the draft proposes the next token of a context the target wrote: every answer position of
the held-out chunks (prompts from the held-out split, answered by the target).

The estimator scores a draft token by logit(q_max), q_max the largest warped draft probability.
`soft_auc` is the probability that a position drawn by its acceptance has a larger score than a
position drawn by its rejection (ties count half): the AUC of the score against accept/reject
outcomes, in expectation over the outcomes, without sampling noise.

`approx_acceptance` takes p from the saved top-64 logits (mass outside them is dropped: the
warped nucleus almost always lies inside): cheap, for the training log. `exact_acceptance`
runs the target itself.

A draft served with a reduced vocabulary (`avspec.engine.draft_vocab`) proposes only its kept
ids: `served_draft` wraps it so every measure here sees that q (logits -inf outside the map,
which is what the draft stage's softmax over the kept ids computes).

Deeper positions: `draft_chains` cuts each held-out sequence inside its answer, lets the draft
draft autoregressively from there and keeps, per context and position, the acceptance, q_max,
the served estimator's feature and the drafted token's acceptance probability
(`acceptance_by_depth` averages the acceptance; the model card uses all four).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from avspec.av.features import logit_qmax
from avspec.engine.draft_vocab import DraftVocab, scatter_kept
from avspec.runtime.transformer import Transformer
from avspec.tools.train.tiny.evaluate import warp

TEMPERATURE = 0.7
TOP_P = 0.95


def load_chunks(directory: Path | str) -> list[dict]:
    """Every sequence of the chunk files in `directory`: `ids` (prompt + answer without its last
    token, int64: the draft's input), `prompt_length`, `answer_length`, `top_ids`, `top_logits`,
    `kind`, and `features` [len(ids), width] float16 where the chunk holds the target's."""
    sequences = []
    for path in sorted(Path(directory).glob("chunk_*.pt")):
        sequences += chunk_sequences(torch.load(path, weights_only=True))
    return sequences


def chunk_sequences(chunk: dict[str, Any]) -> list[dict]:
    """The sequences of one loaded chunk file, as `load_chunks` gives them."""
    sequences = []
    for i, kind in enumerate(chunk["kinds"]):
        prompt, answer = chunk["prompt"][i].long(), chunk["answer"][i].long()
        sequences.append(
            {
                "ids": torch.cat([prompt, answer[:-1]]),
                "answer": answer,
                "prompt_length": len(prompt),
                "answer_length": len(answer),
                "top_ids": chunk["top_ids"][i],
                "top_logits": chunk["top_logits"][i],
                "kind": kind,
            }
            | ({"features": chunk["features"][i]} if "features" in chunk else {})
        )
    return sequences


class ServedDraft(nn.Module):
    """A draft whose logits are -inf outside the kept ids of its draft vocabulary (the kept
    ids' logits widened as the draft stage widens them, `draft_vocab.scatter_kept`)."""

    index: torch.Tensor  # buffer: the kept ids

    def __init__(self, draft: Transformer, vocab: DraftVocab) -> None:
        super().__init__()
        self.draft = draft
        self.register_buffer("index", torch.tensor(vocab.token_ids, dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        logits = self.draft(input_ids)
        return scatter_kept(logits[..., self.index], self.index, logits.shape[-1])


def served_draft(draft: Transformer, vocab: DraftVocab | None) -> nn.Module:
    """`draft` as served: itself without a map, else `ServedDraft`."""
    return draft if vocab is None else ServedDraft(draft, vocab)


def soft_auc(score: torch.Tensor, accept: torch.Tensor) -> float:
    """AUC of `score` against outcomes accepted with probability `accept` (both [n])."""
    order = score.double().argsort()
    s, a = score.double()[order], accept.double()[order]
    reject = 1 - a
    # rejection mass at strictly lower scores, plus half of the other tied positions' mass
    unique, inverse, counts = torch.unique_consecutive(s, return_inverse=True, return_counts=True)
    tied_reject = torch.zeros(len(unique), dtype=torch.float64).index_add_(0, inverse, reject)
    first = torch.cumsum(counts, 0) - counts
    below_group = (torch.cumsum(reject, 0) - reject)[first][inverse]
    below = below_group + 0.5 * (tied_reject[inverse] - reject)
    total = a.sum() * reject.sum() - (a * reject).sum()  # pairs of two distinct positions
    return float((a * below).sum() / total) if total > 0 else float("nan")


def logit(p: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)), clamped away from 0 and 1."""
    p = p.clamp(1e-6, 1 - 1e-6)
    return torch.log(p) - torch.log1p(-p)


def _draft_probs(draft: nn.Module, seq: dict) -> torch.Tensor:
    """The draft's warped q at each answer position [answer_length, vocab]."""
    start = seq["prompt_length"] - 1
    logits = draft(seq["ids"][None])[0, start : start + seq["answer_length"]]
    return warp(logits, TEMPERATURE, TOP_P)


def summarize(accept: torch.Tensor, q_max: torch.Tensor) -> dict[str, float]:
    """Mean acceptance, mean q_max and the AUC of logit(q_max), over all positions."""
    return {
        "acceptance_1": float(accept.mean()),
        "mean_q_max": float(q_max.mean()),
        "auc_logit_q_max": soft_auc(logit(q_max), accept),
        "positions": len(accept),
    }


@torch.no_grad()
def approx_acceptance(draft: nn.Module, heldout: list[dict], limit: int = 24) -> dict:
    """`summarize` with p from the saved top-64 teacher logits (first `limit` sequences)."""
    accepts, q_maxes = [], []
    for seq in heldout[:limit]:
        q = _draft_probs(draft, seq)
        full = torch.full_like(q, float("-inf"))
        full.scatter_(-1, seq["top_ids"].long(), seq["top_logits"].float())
        p = warp(full, TEMPERATURE, TOP_P)
        accepts.append(torch.minimum(p, q).sum(-1))
        q_maxes.append(q.max(-1).values)
    return {f"approx_{k}": v for k, v in summarize(torch.cat(accepts), torch.cat(q_maxes)).items()}


@torch.no_grad()
def exact_acceptance(draft: nn.Module, target: Transformer, heldout: list[dict]) -> dict:
    """`summarize` with p from the target run on each held-out sequence, also per prompt kind."""
    accepts, q_maxes, kinds = [], [], []
    for seq in heldout:
        q = _draft_probs(draft, seq)
        start = seq["prompt_length"] - 1
        target_logits = target(seq["ids"][None])[0, start : start + seq["answer_length"]]
        p = warp(target_logits, TEMPERATURE, TOP_P)
        accepts.append(torch.minimum(p, q).sum(-1))
        q_maxes.append(q.max(-1).values)
        kinds += [seq["kind"]] * len(q)
    accept, q_max = torch.cat(accepts), torch.cat(q_maxes)
    result: dict[str, Any] = summarize(accept, q_max)
    result["by_kind"] = {
        kind: summarize(accept[mask], q_max[mask])
        for kind in sorted(set(kinds))
        for mask in [torch.tensor([k == kind for k in kinds])]
    }
    return result


@dataclass(frozen=True)
class DraftChains:
    """Drafts made autoregressively by the draft from held-out contexts, each [contexts, depth]:
    `accept` = sum_v min(p(v), q(v)) at each position (warped p and q), `q_max` the largest
    warped draft probability, `feature` the served estimator's feature (logit q_max of the
    temperature-scaled draft distribution, `avspec.av.features.logit_qmax`) and `ratio`
    = min(1, p(x) / q(x)) of the drafted token x, the chance verification accepts it."""

    accept: torch.Tensor
    q_max: torch.Tensor
    feature: torch.Tensor
    ratio: torch.Tensor

    @property
    def contexts(self) -> int:
        return self.accept.shape[0]


@torch.no_grad()
def draft_chain(
    draft: Callable[[torch.Tensor], torch.Tensor],
    target: Transformer,
    context: torch.Tensor,
    depth: int,
    generator: torch.Generator | None = None,
    warp_to: tuple[float, float] = (TEMPERATURE, TOP_P),
) -> tuple[torch.Tensor, ...]:
    """(accept, q_max, feature, ratio), each [depth], of one context [seq] int64 (`DraftChains`).

    The draft samples `depth` tokens from its warped q, full recompute, then the target runs
    once over the drafted context: the computation and the random draws of
    `avspec.tools.train.tiny.evaluate.acceptance_by_position` for one prompt, so `accept` equals
    its result for the same generator. `warp_to`: (temperature, top-p) of p and q (temperature
    0: greedy, q and p one-hot, so `accept` says whether the two argmaxes agree)."""
    temperature, top_p = warp_to
    ids = context[None]
    qs, features = [], []
    for _ in range(depth):
        logits = draft(ids)[:, -1]  # (1, vocab)
        q = warp(logits, temperature, top_p)
        features.append(logit_qmax(logits[:, None], temperature)[0, 0])
        token = torch.multinomial(q, 1, generator=generator)
        qs.append(q[0])
        ids = torch.cat([ids, token], dim=1)
    p = warp(target(ids[:, :-1])[:, len(context) - 1 :], temperature, top_p)[0]  # (depth, vocab)
    q = torch.stack(qs)  # (depth, vocab)
    drafted = ids[0, len(context) :, None]
    ratio = (p.gather(-1, drafted) / q.gather(-1, drafted))[:, 0].clamp(max=1.0)
    return torch.minimum(p, q).sum(-1), q.max(-1).values, torch.stack(features), ratio


@torch.no_grad()
def draft_chains(
    draft: Callable[[torch.Tensor], torch.Tensor],
    target: Transformer,
    heldout: list[dict],
    depth: int = 4,
    contexts_per_sequence: int = 1,
    seed: int = 0,
    warp_to: tuple[float, float] = (TEMPERATURE, TOP_P),
) -> DraftChains:
    """`draft_chain` from contexts ending inside held-out answers: each sequence (`ids`,
    `prompt_length`, `answer_length`, as `load_chunks` gives) cut after the prompt plus a
    uniformly drawn share of its answer, `contexts_per_sequence` times."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for seq in heldout:
        for _ in range(contexts_per_sequence):
            cut = int(torch.randint(0, seq["answer_length"], (1,), generator=generator))
            context = seq["ids"][: seq["prompt_length"] + cut]
            rows.append(draft_chain(draft, target, context, depth, generator, warp_to))
    return DraftChains(*(torch.stack(column) for column in zip(*rows, strict=True)))


def acceptance_by_depth(
    draft: nn.Module,
    target: Transformer,
    heldout: list[dict],
    depth: int = 4,
    contexts_per_sequence: int = 1,
    seed: int = 0,
) -> list[float]:
    """Mean sum_v min(p, q) at draft positions 1..`depth` over `draft_chains` (the draft
    samples from its warped q, the target's warped p is taken at each drafted context)."""
    chains = draft_chains(draft, target, heldout, depth, contexts_per_sequence, seed)
    return chains.accept.mean(0).tolist()
