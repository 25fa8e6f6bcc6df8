"""A draft head behind the face a draft model shows the model card: `drafter(ids)` -> logits.

`evaluate.draft_chain` drafts by calling `draft(ids)` on the context, then on the context plus
each token it drew. `HeadDrafter` answers those calls as the served head drafts
(`avspec.engine.head_stage`): the target has run the context but its last token (the target's
own sample in serving), so the head's entries are (f_t, token t + 1) with the target's
features f_t for every context position but the last, and from there its own guesses f^ fed
back with the tokens drawn. A call that does not extend the previous one by one token starts a
new context. Logits are the head's over the kept ids of its draft vocabulary (-inf elsewhere),
[1, 1, vocab] at the last position only: all the chain reads.
"""

from __future__ import annotations

import torch

from avspec.engine.draft_vocab import scatter_kept
from avspec.runtime.head import DraftHead
from avspec.runtime.transformer import Transformer


@torch.no_grad()
def final_features(target: Transformer, ids: torch.Tensor) -> torch.Tensor:
    """The target's last block output after its final norm, [batch, seq, width] for ids
    [batch, seq]: the features a head reads."""
    x = target.embed(ids)
    for block in target.blocks:
        x = block(x, target.rotary)
    return target.final_norm(x)


class HeadDrafter:
    """`head` over `target`'s features, drafting over the ids `kept` (None: every id)."""

    def __init__(self, head: DraftHead, target: Transformer, kept: torch.Tensor | None) -> None:
        self.head, self.target = head, target
        self.kept = kept
        self.rows = head.layers.embed.weight if kept is None else head.layers.embed.weight[kept]
        self._ids: torch.Tensor | None = None
        self._features = torch.empty(0)
        self._guess = torch.empty(0)

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [1, n] -> logits [1, 1, vocab] of the token after them."""
        previous = self._ids
        extends = (
            previous is not None
            and ids.shape[1] == previous.shape[1] + 1
            and torch.equal(ids[:, :-1], previous)
        )
        if extends:  # the token drawn from the last guess: an entry of the head's own
            self._features = torch.cat([self._features, self._guess], dim=1)
        else:  # a new context: the target ran all of it but its last token
            if ids.shape[1] < 2:
                raise ValueError("a head drafts after a context of at least 2 tokens")
            self._features = final_features(self.target, ids[:, :-1]).to(self.rows.dtype)
        guesses = self.head(self._features, ids[:, 1:])  # entry t: (f_t, token t + 1)
        self._guess = guesses[:, -1:]
        self._ids = ids
        logits = self.head.logits(self._guess, self.rows)  # [1, 1, kept]
        if self.kept is None:
            return logits
        return scatter_kept(logits[0], self.kept, self.head.config.vocab_size)[None]
