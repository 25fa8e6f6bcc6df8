"""The draft stage of one speculative step: feed pending tokens, then draft up to K tokens per row.

One `forward_cached` call runs every sequence's pending inputs (prefill and decode mixed); the
logits at each sequence's last pending token give draft 0. Then one-token decode passes each
feed the previous draft of the rows still drafting and sample the next one. The last draft is
never fed: if it is accepted, the next step brings it back as an input and the cache rule (keep
`min(cached, start + reusable)`) makes the draft run it then.

How far a row drafts (avspec.av.drafting): without a plan, or for a row that is not adaptive or not
drafting adaptively, to its `num_draft_tokens`. Otherwise to at most the plan's depth D (0: nothing,
when the previous step's budget admitted no draft), and past position i only while its survival
under the plan's (start-of-step) coefficients stays >= tau. The output layer runs only for the rows
that draft. A step in which no row drafts (a plan of depth 0, or no row asking for drafts) runs
nothing: each row's pending inputs are deferred (`SequenceSlots.defer`) and run in front of its
inputs of the next step that drafts, so the draft's cache is current whenever it draws. On a
memory-bound GPU that saves the whole pass (a pass over 16 rows costs what one over 1 does); where
compute binds (this CPU) the tokens cost about the same later, and the step saves the pass's fixed
cost. In a step in which some rows draft, a row that draws nothing (limit 0: a probe that did not
take it, a cap of 0) defers its inputs the same way: the pass runs the drawing rows only, so a
row that never drafts never pays for the draft's pass over its tokens. On the CPU a row that
stopped leaves the batch of the next pass (compaction: the pass costs what its rows cost). On
CUDA the rows are masked instead, so the loop never reads a device value: D and the limits are
host numbers from the plan, stopped rows still run but draft nothing (not yet run on a GPU).

Each draft is sampled from the warped draft distribution q (avspec.engine.sampling, same warp as the
target) with the sequence's own generator; the feature is logit(q_max) of the temperature-scaled
logits (avspec.av.features). Positions >= a row's `num_drafted` are padding: token 0, q = 0,
feature 0. `draft_probs` is `vocab_width` wide (the stage's `vocab_limit` when set): q over the
real tokens only, the padded rows (q = 0 after masking) dropped. `pass_ms` times each pass on
the host clock (the cost refresh reads it; on CUDA it is launch time unless the caller
synchronises).

With a reduced vocabulary (`draft_vocab`, avspec.engine.draft_vocab) the model's passes stop
before its output layer; the logits of the kept ids only are computed (at each row's last pending
token, not at every prefill token), and the warp, the sample and the feature run in the map's own
index space (n kept ids, not the vocabulary): the sampled index is mapped to its token id, and q
is written into `draft_probs` at the kept ids, 0 elsewhere. This is the full-width computation
over logits that are -inf outside the map, without its vocabulary-wide work: the ids are sorted
ascending, so ties (nucleus, greedy argmax) resolve to the same ids; the vocab_limit mask has
nothing to do (the map's ids lie below it). The feature is logit(q_max) of the logits the draft
samples from, and q is the distribution each draft was drawn from, so verification is exact.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from avspec.av.drafting import DraftPlan, draft_limits, keeps_drafting, stop_confidence
from avspec.av.features import logit_qmax
from avspec.contract import HostStep, StepInputs, read_step_inputs
from avspec.engine.draft_vocab import DraftVocab, KeptColumns, ReducedHead, check_token_ids
from avspec.engine.sampling import draft_warp, sample
from avspec.engine.stage import DRAFT_SALT, ModelStage
from avspec.runtime.transformer import Transformer


@dataclass
class DraftOutput:
    """Drafts of one step. Positions past a row's num_drafted are padding."""

    draft_tokens: torch.Tensor  # [batch, K] int32
    # [batch, P, vocab_width] float32, the warped q of each draft; P (1..K) covers the positions
    # any row may draft this step (its cap, or the plan's depth), K on CUDA: a 64-row step whose
    # rows draft at most 2 does not allocate and hand on K = 8 vocabulary-wide rows per request
    draft_probs: torch.Tensor
    draft_features: torch.Tensor  # [batch, K] float32, logit(q_max) per position
    num_drafted: torch.Tensor  # [batch] int32, <= num_draft_tokens
    pass_ms: torch.Tensor  # [K] float32 (CPU), host ms of each pass; 0 = not run


class DraftStage(ModelStage):
    """Draft model stage; owns the draft KV cache and the draft generators."""

    SALT = DRAFT_SALT

    def __init__(
        self, *args: Any, top_k: int = 0, draft_vocab: DraftVocab | None = None, **kwargs: Any
    ) -> None:
        """`ModelStage`'s arguments plus `top_k`: draft from the top_k most probable tokens
        within top-p (`engine.sampling.draft_warp`; 0: the target's warp), and `draft_vocab`:
        compute logits for its kept ids only, q = 0 elsewhere (None: the whole vocabulary).
        The map's ids must lie below `vocab_width`."""
        super().__init__(*args, **kwargs)
        if not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0: the target's warp), got {top_k!r}")
        self.top_k = top_k
        self.head: ReducedHead | KeptColumns | None = None
        if draft_vocab is not None:
            where = f"draft vocabulary {draft_vocab.path}" if draft_vocab.path else "draft_vocab"
            check_token_ids(list(draft_vocab.token_ids), self.vocab_width, where)
            self.head = (
                ReducedHead(self.model, draft_vocab)
                if isinstance(self.model, Transformer)
                else KeptColumns(self.model.vocab_size, draft_vocab)
            )

    @torch.inference_mode()
    def __call__(self, inputs: StepInputs) -> DraftOutput:
        """Release, apply the cache rule, run pending inputs, and draft; see the module doc."""
        step = read_step_inputs(inputs, self.max_draft_tokens)
        plan = DraftPlan.from_tensor(inputs.draft_plan, self.max_draft_tokens)
        batch, k, vocab = inputs.batch_size, self.max_draft_tokens, self.vocab_width
        limits, stops = draft_limits(
            step.num_draft_tokens, step.adaptive, step.adaptive_drafting, plan, step.seq_ids
        )
        started = time.perf_counter()
        hidden = self._pending(step, inputs, limits)  # may lower limits (a head: no features)
        width = max(1, *limits) if self.compact and batch else k  # P, see DraftOutput
        out = DraftOutput(
            torch.zeros(batch, k, dtype=torch.int32, device=self.device),
            torch.zeros(batch, width, vocab, dtype=torch.float32, device=self.device),
            torch.zeros(batch, k, dtype=torch.float32, device=self.device),
            torch.zeros(batch, dtype=torch.int32, device=self.device),
            torch.zeros(k, dtype=torch.float32),
        )
        if hidden is None:  # an empty batch
            return out
        temperature = inputs.temperature.to(self.device, torch.float32)
        top_p = inputs.top_p.to(self.device, torch.float32)
        generators = self.slots.generators(step.seq_ids)
        alive = _Alive(stops, plan, self.device, compact=self.compact)
        rows = list(range(batch))
        for position in range(k):
            rows = [r for r in rows if limits[r] > position and alive.may_draft(r)]
            if not rows:
                if position == 0 and hidden.numel():  # no draw, but the pending pass ran
                    out.pass_ms[0] = (time.perf_counter() - started) * 1e3
                break  # (an empty `hidden`: the pass's inputs were deferred, it did not run)
            index = torch.tensor(rows, device=self.device)  # [rows]
            if position == 0:
                logits = self._logits(hidden[index])
            else:
                previous = out.draft_tokens[index, position - 1].long()  # [rows]
                logits = self._next_logits([step.seq_ids[r] for r in rows], index, previous)
            draw = _Draw(index, temperature[index], top_p[index], [generators[r] for r in rows])
            features = self._draft_position(position, draw, logits, out, alive.mask(index))
            alive.update(rows, index, position, features)
            now = time.perf_counter()
            out.pass_ms[position] = (now - started) * 1e3
            started = now
        return out

    def _pending(
        self, step: HostStep, inputs: StepInputs, limits: list[int]
    ) -> torch.Tensor | None:
        """Apply the cache rule and run the pending inputs of every row that draws: the last
        block's output [batch, width] at each such row's last pending token (where draft 0's
        logits come from; the output layer runs on the rows that draft only; 0 at the other
        rows), [batch, 0] when no row draws, None for an empty batch. A row that draws nothing
        (limit 0) defers its inputs: nothing reads its pass, they run in front of its inputs of
        the next step it draws in. A subclass may lower `limits` (in place) for rows it cannot
        draft."""
        offsets = self.slots.prepare(step)
        if not step.seq_ids:
            return None
        rows = [inputs.input_ids[r, offsets[r] : n] for r, n in enumerate(step.input_lengths)]
        draws = [r for r, limit in enumerate(limits) if limit > 0]
        for r, seq_id in enumerate(step.seq_ids):
            if limits[r] == 0:
                self.slots.defer(seq_id, rows[r])
        if not draws:
            return torch.zeros(len(rows), 0, device=self.device)  # no row reads it
        ids = [step.seq_ids[r] for r in draws]
        run = []
        for r, seq_id in zip(draws, ids, strict=True):
            deferred = self.slots.take_deferred(seq_id)
            run.append(rows[r] if deferred is None else torch.cat([deferred, rows[r]]))
        lengths = [int(tokens.numel()) for tokens in run]
        packed = torch.cat(run).to(self.device, torch.int64)  # [tokens]
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1  # [draws]
        hidden = self.forward_cached(ids, packed, lengths, at=last)
        if len(draws) == len(rows):
            return hidden
        full = hidden.new_zeros(len(rows), hidden.shape[1])
        full[torch.tensor(draws, device=self.device)] = hidden
        return full

    def _next_logits(
        self, seq_ids: list[int], index: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """Feed each drafting row's previous draft `previous` [rows] (rows `index` of the
        batch); the logits of its next draft."""
        return self._forward(seq_ids, previous, [1] * len(seq_ids))

    def _forward(
        self,
        seq_ids: list[int],
        tokens: torch.Tensor,
        lengths: list[int],
        last: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run packed `tokens` through the model (cached); the logits at the tokens `last`
        [rows] (None: every token), as `_logits` gives them."""
        hidden = self.forward_cached(seq_ids, tokens, lengths, at=last)
        return self._logits(hidden)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Last block outputs [rows, width] -> logits [rows, model vocab], or with a reduced
        vocabulary the kept ids' only, [rows, kept] in the map's order (`_head`)."""
        return self.model.logits(hidden) if self.head is None else self._head(hidden)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The reduced output layer: last block outputs [rows, width] -> the kept ids' logits
        [rows, kept]."""
        assert self.head is not None
        return self.head.kept_logits(hidden)

    def _token_ids(self, drawn: torch.Tensor) -> torch.Tensor:
        """Drawn indices [rows] into the logits `_head` gives -> token ids: the map's ids at
        those indices (without a map the indices are the ids)."""
        return drawn if self.head is None else self.head.index[drawn]

    @property
    def compact(self) -> bool:
        """Drop stopped rows from later passes (reads a device value per pass: CPU only)."""
        return self.device.type == "cpu"

    def _draft_position(
        self,
        position: int,
        draw: _Draw,
        logits: torch.Tensor,
        out: DraftOutput,
        drafting: torch.Tensor | None,
    ) -> torch.Tensor:
        """Sample draft `position` of the rows in `draw` from logits [rows, vocab], or with a
        reduced vocabulary [rows, kept] (the map's index space, see the module doc).

        drafting [rows] bool or None (all): rows masked off (CUDA, stopped) keep padding.
        Returns the rows' features [rows].
        """
        logits = logits[:, None, :]  # [rows, 1, width]
        if self.head is None:
            logits = self.mask_vocab(logits)  # in place
        check = self.check_values
        q = draft_warp(logits, draw.temperature, draw.top_p, self.top_k, check_values=check)[:, 0]
        tokens = self._token_ids(sample(q, draw.generators, check_values=check)).int()
        features = logit_qmax(logits, draw.temperature, check_values=check)[:, 0]  # [rows]
        if drafting is not None:
            tokens = torch.where(drafting, tokens, 0)
            q = torch.where(drafting[:, None], q, 0.0)
            features = torch.where(drafting, features, 0.0)
            out.num_drafted[draw.index] += drafting.int()
        else:
            out.num_drafted[draw.index] += 1
        out.draft_tokens[draw.index, position] = tokens
        if self.head is None:
            out.draft_probs[draw.index, position] = q[:, : self.vocab_width]  # padded rows: 0
        else:  # the kept ids' entries only; every other id stays 0
            rows, ids = draw.index[:, None], self.head.index[None, :]
            out.draft_probs[rows, position, ids] = q
        out.draft_features[draw.index, position] = features
        return features


class _Alive:
    """Which rows still draft: the per-request stop of the plan, compacted or masked.

    Compact (CPU): a stopped row leaves `rows` (host read of a [rows] bool per pass). Masked
    (CUDA): a device mask [batch]; rows keep running but draft nothing once stopped.
    """

    def __init__(
        self, stops: list[bool], plan: DraftPlan | None, device: torch.device, compact: bool
    ) -> None:
        self.plan = plan
        self.compact = compact
        self.any = plan is not None and any(stops)
        self.stopped: set[int] = set()  # compact mode
        if not self.any:  # no row stops by a plan: nothing to track (most steps without AV)
            return
        batch = len(stops)
        self.survival = torch.ones(batch, dtype=torch.float32, device=device)
        self.stops_t = torch.tensor(stops, dtype=torch.bool, device=device)
        self.drafting = torch.ones(batch, dtype=torch.bool, device=device)  # masked mode

    def may_draft(self, row: int) -> bool:
        return row not in self.stopped

    def mask(self, index: torch.Tensor) -> torch.Tensor | None:
        """[rows] bool of rows that draft this position, or None when every row does."""
        if self.compact or not self.any:
            return None
        return self.drafting[index]

    def update(
        self, rows: list[int], index: torch.Tensor, position: int, features: torch.Tensor
    ) -> None:
        """After drafting `position`: survival *= c_position; stop rows below tau."""
        if not self.any:
            return
        plan = self.plan
        assert plan is not None
        confidence = stop_confidence(features, position, plan)
        self.survival[index] = self.survival[index] * confidence
        keep = keeps_drafting(self.survival[index], plan) | ~self.stops_t[index]
        if self.compact:
            self.stopped.update(r for r, k in zip(rows, keep.tolist(), strict=True) if not k)
        else:
            self.drafting[index] = self.drafting[index] & keep


@dataclass
class _Draw:
    """The rows drafting at one position and their sampling settings."""

    index: torch.Tensor  # [rows] int64, rows of the batch
    temperature: torch.Tensor  # [rows] float32
    top_p: torch.Tensor  # [rows] float32
    generators: list[torch.Generator]
