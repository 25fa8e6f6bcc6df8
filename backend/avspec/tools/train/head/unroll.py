"""Training-time test: the head run as it drafts, `depth` steps deep, in one dense pass each.

Served, the head drafts its first token from the target's feature f_t, its second from its own
guess f^_{t+1}, and so on; its block attends to the cached entries of every accepted position
(made from the target's features) and to its own entries of this step. A head trained on the
target's features alone never sees its own guesses as input and falls off with depth (EAGLE-3's
"training-time test" trains it on them).

`unroll` makes every position of a row the start of a chain at once. Depth 1 is the plain
causal pass over the target's features. At depth d >= 2 the input at position j is the guess
of depth d - 1 at position j - 1 (the guess of f_j), with the true token t_{j+1}, and its query
attends to what the served chain at that depth would see:

    depth-1 keys at positions <= j - (d - 1)      (accepted positions: the target's features)
    depth-k keys at position j - (d - k), 2 <= k <= d   (the chain's own earlier drafts)

so position j at depth d is exactly the d-th draft of a chain started after position
j - (d - 1), tokens taken from the data (teacher forcing), features from the head's guesses.
Every depth predicts the same targets at j (f_{j+1} and token t_{j+2}); positions j < d - 1
have no such chain and are left out of the loss by `valid_from`.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from avspec.runtime.head import DraftHead
from avspec.runtime.transformer import Block


def chain_mask(length: int, depth: int) -> Tensor:
    """[length, depth * length] bool: which keys (depth 1's, then depth 2's, ...) a query at
    each position of depth `depth` attends to (see the module docstring)."""
    j = torch.arange(length)[:, None]
    i = torch.arange(length)[None, :]
    parts = [i <= j - (depth - 1)]
    parts += [i == j - (depth - k) for k in range(2, depth + 1)]
    return torch.cat(parts, dim=1)


def unroll(head: DraftHead, features: Tensor, tokens: Tensor, depth: int) -> list[Tensor]:
    """The head's guesses f^ [batch, seq, width] at depths 1..`depth` (a list): features
    [batch, seq, width] the target's (f_j), tokens [batch, seq] the token after each (t_{j+1})."""
    block, rotary = cast(Block, head.layers.blocks[0]), head.layers.rotary
    length = features.shape[1]
    angles = rotary.angles(torch.arange(length), features.dtype)
    embedded = head.layers.embed(tokens).to(features.dtype)
    keys: list[Tensor] = []
    values: list[Tensor] = []
    guesses: list[Tensor] = []
    inputs = features
    for d in range(1, depth + 1):
        x = head.fc(torch.cat([inputs, embedded], dim=-1))
        q, k, v = block.project(x, rotary, angles)  # (batch, seq, heads, head_dim)
        keys.append(k)
        values.append(v)
        key, value = (torch.cat(t, dim=1).transpose(1, 2) for t in (keys, values))
        mask = chain_mask(length, d) if d > 1 else None
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), key, value, attn_mask=mask, is_causal=d == 1,
            enable_gqa=block.grouped,
        )  # fmt: skip
        h = block.mlp(x + block.attn_out(att.transpose(1, 2).flatten(-2)))
        guess = head.layers.final_norm(h)
        guesses.append(guess)
        # the next depth's input at j: this depth's guess at j - 1 (position 0 has none)
        inputs = torch.cat([features[:, :1], guess[:, :-1]], dim=1)
    return guesses


def valid_from(depth: int) -> int:
    """The first position with a chain `depth` deep (position j needs j >= depth - 1)."""
    return depth - 1
