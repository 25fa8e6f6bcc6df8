"""Held-out measures of the head from saved data alone: acceptance by depth, teacher-forced.

For each held-out sequence the head is unrolled `depth` steps (`unroll`): at depth d, position
j is the d-th draft of a chain started after position j - d + 1, its input feature the head's
own guess, its input tokens the target's (teacher forcing). Its acceptance is
sum_v min(p(v), q(v)), p the target's top-64 logits, q the head's softmax over the kept ids,
both warped as served (temperature 0.7, top-p 0.95), at the answer positions. The served chain
drafts its own tokens, and its deeper drafts follow a rejected one only in expectation, so the
deeper figures here are an upper estimate for training logs; the model card measures chains
the head samples itself, against the target run on them.
"""

from __future__ import annotations

import torch

from avspec.engine.draft_vocab import scatter_kept
from avspec.runtime.head import DraftHead
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P, logit, soft_auc
from avspec.tools.train.head.batch import head_batch
from avspec.tools.train.head.unroll import unroll, valid_from
from avspec.tools.train.tiny.evaluate import warp


@torch.no_grad()
def head_outcomes(
    head: DraftHead, sequences: list[dict], kept: torch.Tensor, depth: int = 3
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per depth 1..`depth`: (acceptance, q_max) [positions] at every answer position of
    `sequences` (with features) the head reaches at that depth, its earlier guesses fed back."""
    accepts: list[list[torch.Tensor]] = [[] for _ in range(depth)]
    q_maxes: list[list[torch.Tensor]] = [[] for _ in range(depth)]
    rows = head.layers.embed.weight[kept].float()
    vocab = head.config.vocab_size
    for sequence in sequences:
        batch = head_batch([sequence])
        guesses = unroll(head, batch.features, batch.tokens, depth)
        full = torch.full((len(batch.top_ids), vocab), float("-inf"))
        full.scatter_(-1, batch.top_ids, batch.top_logits.float())
        p_all = warp(full, TEMPERATURE, TOP_P)
        for d, guess in enumerate(guesses):
            mask = batch.token_mask.clone()
            mask[:, : valid_from(d + 1)] = False
            reach = mask[batch.token_mask]
            logits = scatter_kept(head.logits(guess[mask], rows), kept, vocab)
            q = warp(logits, TEMPERATURE, TOP_P)
            accepts[d].append(torch.minimum(p_all[reach], q).sum(-1))
            q_maxes[d].append(q.max(-1).values)
    return [(torch.cat(a), torch.cat(q)) for a, q in zip(accepts, q_maxes, strict=True)]


def head_acceptance(
    head: DraftHead, sequences: list[dict], kept: torch.Tensor, depth: int = 3
) -> dict[str, list[float]]:
    """Per depth 1..`depth`: `acceptance` (mean), `q_max` (mean) and `auc` of logit(q_max)
    against acceptance, over `head_outcomes`."""
    result: dict[str, list[float]] = {"acceptance": [], "q_max": [], "auc": []}
    for accept, q_max in head_outcomes(head, sequences, kept, depth):
        result["acceptance"].append(round(float(accept.mean()), 4))
        result["q_max"].append(round(float(q_max.mean()), 4))
        result["auc"].append(round(soft_auc(logit(q_max), accept), 4))
    return result
