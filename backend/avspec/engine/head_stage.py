"""The draft stage with a draft head: drafts from the target's features (avspec.runtime.head).

The head's cache entry at position p is made from the target's feature f_p and the committed
token p + 1, so it can be made only once the target has run position p. Each step therefore:

1. takes the features the target sent after the previous step (`StepInputs.prev_target_features`,
   rows in the previous call's batch order, each row's features at consecutive positions from
   its `prev_feature_starts`) and this step's committed tokens (`input_ids` at positions
   start..start + input_length - 1) into the row's `HeadRow`;
2. rolls the head's cache back to its true entries (the last step's drafts made guess entries)
   and appends every entry it now can, for all rows in one packed pass;
3. drafts from the last true entry, when it is the one before the newest committed token
   (position T - 2, T the committed length): draft 1 is sampled from that entry's output, each
   next draft from an entry made of the head's own guess f^ and the previous draft. A row whose
   features have not come yet (its first step: the target has not run its prompt) drafts
   nothing this step, and so does a row whose features were lost with a failed step: its
   output stays exact, it only goes without speculation.

Sampling, the warp, the reduced vocabulary, the adaptive plan and the outputs are the draft
stage's own (avspec.engine.draft_stage); only where the logits come from differs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import torch

from avspec.contract import HostStep, StepInputs
from avspec.engine.draft_stage import DraftStage
from avspec.runtime.head import DraftHead
from avspec.runtime.kv_cache import KVCache
from avspec.runtime.transformer import Transformer


@dataclass
class HeadRow:
    """One sequence's state in the head: its true entries and what is known past them."""

    entries: int = 0  # the head's cache holds true entries at positions 0..entries - 1
    feature_start: int = 0  # `features` [n, width] are the target's at feature_start..
    features: torch.Tensor | None = None
    token_start: int = 0  # `tokens` are the committed tokens at token_start..
    tokens: list[int] = field(default_factory=list)
    last: torch.Tensor | None = None  # [width] the block's output at the last true entry

    def add_features(self, start: int, features: torch.Tensor) -> None:
        """The target's features at positions start.. (see `merged`)."""
        if self.features is None:
            self.feature_start, self.features = start, features
            return
        self.feature_start, self.features = merged(
            self.feature_start, self.features, start, features, torch.cat
        )

    def add_tokens(self, start: int, tokens: list[int]) -> None:
        """Committed tokens at positions start.. (see `merged`)."""
        self.token_start, self.tokens = merged(
            self.token_start, self.tokens, start, list(tokens), lambda parts: sum(parts, [])
        )

    def ready(self) -> int:
        """How many new entries can be made now (positions entries.. with a feature there and
        the token after it)."""
        if self.features is None or not self.feature_start <= self.entries:
            return 0
        if not self.token_start <= self.entries + 1:
            return 0
        feature_end = self.feature_start + len(self.features)
        token_end = self.token_start + len(self.tokens)
        return max(0, min(feature_end, token_end - 1) - self.entries)

    def take(self, count: int) -> tuple[torch.Tensor, list[int]]:
        """The features and next tokens of the next `count` entries; forget what they used."""
        assert self.features is not None
        f0, t0 = self.entries - self.feature_start, self.entries + 1 - self.token_start
        features, tokens = self.features[f0 : f0 + count], self.tokens[t0 : t0 + count]
        self.entries += count
        self.features = self.features[f0 + count :]
        self.feature_start = self.entries
        self.tokens = self.tokens[t0 + count :]
        self.token_start = self.entries + 1
        return features, tokens


def merged(base: int, known: Any, start: int, new: Any, join: Any) -> tuple[int, Any]:
    """Values at consecutive positions from `base` (`known`), updated with `new` from `start`:
    a value of a committed position never changes, so `new` overwrites what it covers and the
    rest stays; positions before `base` (already used) are dropped, and a gap after the known
    values drops those (entries cannot skip a position). `join` concatenates a list of parts."""
    if start > base + len(known):
        return start, new
    if start < base:
        new, start = new[base - start :], base
    at = start - base
    return base, join([known[:at], new, known[at + len(new) :]])


class HeadDraftStage(DraftStage):
    """`DraftStage` over a `DraftHead`: the model is the head's one-block transformer (its KV
    cache, its output layer through the target's embedding), the head's `fc` makes its inputs."""

    def __init__(self, head: DraftHead, cache: KVCache, *args: Any, **kwargs: Any) -> None:
        super().__init__(head.layers, cache, *args, **kwargs)
        self.draft_head = head
        self.rows: dict[int, HeadRow] = {}
        self._previous: list[int] = []  # the last call's seq ids (prev_* rows' order)
        self._hidden: torch.Tensor | None = None  # [batch, width], each row's latest output

    def _pending(
        self, step: HostStep, inputs: StepInputs, limits: list[int]
    ) -> torch.Tensor | None:
        self.slots.admit(step)
        for seq_id in [s for s in self.rows if not self.cache.has(s)]:
            del self.rows[seq_id]  # released or swept
        self._take_features(inputs)
        self._previous = list(step.seq_ids)
        if not step.seq_ids:
            return None
        batch, width = len(step.seq_ids), self._layers.config.width
        hidden = torch.zeros(batch, width, device=self.device, dtype=self._dtype)
        counts, features, tokens = [], [], []
        for r, (seq_id, start) in enumerate(zip(step.seq_ids, step.start_positions, strict=True)):
            if start == 0:
                self.rows[seq_id] = HeadRow()
            row = self.rows.setdefault(seq_id, HeadRow())
            length = step.input_lengths[r]
            row.add_tokens(start, inputs.input_ids[r, :length].tolist())
            cast(KVCache, self.cache).rollback(seq_id, row.entries)
            count = row.ready()
            counts.append(count)
            if count:
                f, t = row.take(count)
                features.append(f)
                tokens += t
            committed = start + length
            if row.entries != committed - 1 or (count == 0 and row.last is None):
                limits[r] = 0  # no entry right before the newest token: nothing to draft from
        ran = [r for r, c in enumerate(counts) if c]
        if ran:
            outputs = self._enter(
                [step.seq_ids[r] for r in ran],
                torch.cat(features),
                tokens,
                [counts[r] for r in ran],
            )
            for i, r in enumerate(ran):
                self.rows[step.seq_ids[r]].last = outputs[i]
        for r, seq_id in enumerate(step.seq_ids):
            last = self.rows[seq_id].last
            if limits[r] and last is not None:
                hidden[r] = last
        self._hidden = hidden
        return hidden

    def _take_features(self, inputs: StepInputs) -> None:
        """File the previous step's target features under their rows (previous batch order)."""
        counts = inputs.prev_feature_counts.tolist()
        if not counts:
            return
        if len(counts) != len(self._previous):  # not the step this stage saw last: unusable
            return
        starts = inputs.prev_feature_starts.tolist()
        chunks = inputs.prev_target_features.to(self.device, self._dtype).split(counts)
        for seq_id, start, chunk in zip(self._previous, starts, chunks, strict=True):
            if len(chunk) and seq_id in self.rows:
                self.rows[seq_id].add_features(start, chunk)

    def _enter(
        self, seq_ids: list[int], features: torch.Tensor, tokens: list[int], lengths: list[int]
    ) -> torch.Tensor:
        """Append true entries (packed rows); the block's output at each row's last one."""
        ids = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1
        return self._run(seq_ids, features, ids, lengths, last)

    def _next_logits(
        self, seq_ids: list[int], index: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """A guess entry per drafting row: its last output's f^ and its previous draft."""
        assert self._hidden is not None
        guess = self._layers.final_norm(self._hidden[index])
        output = self._run(seq_ids, guess, previous, [1] * len(seq_ids), None)
        self._hidden[index] = output
        return self._logits(output)

    def _run(
        self, seq_ids: list[int], features: torch.Tensor, tokens: torch.Tensor,
        lengths: list[int], at: torch.Tensor | None,
    ) -> torch.Tensor:  # fmt: skip
        """The head's block over packed entries (features [n, width], tokens [n]) on its cache:
        the block's output (before the final norm) at `at` (None: every entry)."""
        embeds = self.draft_head.inputs(features.to(self._dtype), tokens)
        cache = cast(KVCache, self.cache)
        return self._layers.forward_cached(
            cache, seq_ids, tokens, lengths, hidden=True, at=at, embeds=embeds
        )

    @property
    def _layers(self) -> Transformer:
        return cast(Transformer, self.model)

    @property
    def _dtype(self) -> torch.dtype:
        return self.draft_head.fc.weight.dtype
