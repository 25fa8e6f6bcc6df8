"""A training batch for the head: sequences of the draft pipeline's chunks, with the target's
features, right-padded into dense tensors.

A sequence (`avspec.tools.train.draft.evaluate.load_chunks` with `features`) is prompt + answer
without its last token (`ids`, length L), the target's feature at each of those positions
(`features` [L, width]) and the target's top-64 logits at each answer token (`top_ids`,
`top_logits` [A, 64]). Position j of the head takes f_j and token j + 1 (the last position takes
the answer's last token) and is scored on:

- f_{j+1}, the target's next feature, for j <= L - 2 (`feature_mask`);
- the target's distribution of token j + 2, for the answer tokens only: answer index
  a = j + 2 - P (P the prompt's length) in 0..A-1 (`token_mask`, `top_ids` and `top_logits`
  of those positions in row order).

Only the last `PROMPT_CONTEXT` prompt positions are kept: the head's attention needs a context,
not the whole prompt, and a long prompt would cost more than its answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

PROMPT_CONTEXT = 128


@dataclass(frozen=True)
class HeadBatch:
    """Dense tensors of a batch of sequences (see the module docstring); [batch, seq] masks."""

    features: Tensor  # [batch, seq, width] float32: f_j (0 past a row's end)
    tokens: Tensor  # [batch, seq] int64: token j + 1
    feature_mask: Tensor  # [batch, seq] bool: positions scored on f_{j+1}
    token_mask: Tensor  # [batch, seq] bool: positions scored on token j + 2
    top_ids: Tensor  # [scored, 64] int64: the target's top ids at token_mask's positions
    top_logits: Tensor  # [scored, 64] float16: and their logits

    @property
    def next_features(self) -> Tensor:
        """[batch, seq, width]: f_{j+1} at j (0 at the last position)."""
        shifted = torch.zeros_like(self.features)
        shifted[:, :-1] = self.features[:, 1:]
        return shifted


def trimmed(sequence: dict, context: int = PROMPT_CONTEXT) -> dict:
    """`sequence` with only its last `context` prompt positions (the answer kept whole)."""
    cut = max(0, sequence["prompt_length"] - context)
    if cut == 0:
        return sequence
    return sequence | {
        "ids": sequence["ids"][cut:],
        "features": sequence["features"][cut:],
        "prompt_length": sequence["prompt_length"] - cut,
    }


def head_batch(sequences: list[dict], context: int = PROMPT_CONTEXT) -> HeadBatch:
    """The dense batch of `sequences` (each with `features`; see the module docstring)."""
    rows = [trimmed(s, context) for s in sequences]
    width = rows[0]["features"].shape[-1]
    length = max(len(s["ids"]) for s in rows)
    features = torch.zeros(len(rows), length, width)
    tokens = torch.zeros(len(rows), length, dtype=torch.long)
    feature_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    token_mask = torch.zeros(len(rows), length, dtype=torch.bool)
    top_ids, top_logits = [], []
    for r, s in enumerate(rows):
        n, p = len(s["ids"]), s["prompt_length"]
        if s["features"].shape[0] != n:
            raise ValueError(f"a sequence has {n} ids but {s['features'].shape[0]} features")
        features[r, :n] = s["features"].float()
        tokens[r, : n - 1] = s["ids"][1:]
        tokens[r, n - 1] = s["answer"][-1]
        feature_mask[r, : n - 1] = True
        first = max(0, 2 - p)  # the first answer index with a position j >= 0
        token_mask[r, p - 2 + first : n - 1] = True
        top_ids.append(s["top_ids"][first:].long())
        top_logits.append(s["top_logits"][first:])
    return HeadBatch(
        features, tokens, feature_mask, token_mask, torch.cat(top_ids), torch.cat(top_logits)
    )
