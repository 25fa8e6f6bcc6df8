"""The target stage of one speculative step: verify each row's admitted drafts and sample.

One `forward_cached` call runs, per sequence, its pending inputs followed by its first
`num_verify` drafts (a ragged batch). The target distribution at draft position j comes from the
logits one token earlier: position 0 from the last pending input, position j from draft j - 1;
position num_verify gives the bonus token. The forward keeps the last block's output at those
num_verify + 1 positions per row (packed row after row); rejection asks for p where it reads it,
and only there the output layer runs and the logits are warped like the draft's
(avspec.engine.sampling), p sliced to the stage's `vocab_width` (its `vocab_limit` when set, the
width of the draft's q). On the CPU that is depth by depth (avspec.engine.rejection's
`rejection_sample` given a function for p): a row's accepted drafts and the position its token
is drawn at, so a step's output-layer and sampling work grows with the tokens it accepts, not
with those it verifies; elsewhere every verified position at once (the packed form). Afterwards
the target cache is rolled back to `start + input_length + num_accepted`: the accepted drafts
stay cached (their keys are exact), rejected drafts go, and the correction/bonus token is not
cached (the next step brings it back as an input). `target_ms` is the stage's host wall time
(the cost refresh reads it; the roll-back reads num_accepted, so on CUDA it includes the device
work).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from avspec.checks import check_shape
from avspec.contract import HostStep, StepInputs, StepOutputs, read_step_inputs
from avspec.engine.rejection import RequestStreams, rejection_sample
from avspec.engine.sampling import warp_probs
from avspec.engine.stage import TARGET_SALT, ModelStage, StageModel
from avspec.runtime.transformer import Transformer


@dataclass
class VerifyBatch:
    """The ragged batch of one target pass and where each row's target logits sit in it."""

    tokens: torch.Tensor  # [tokens] int64: per row, its pending inputs then its verified drafts
    lengths: list[int]  # per row, its number of tokens in `tokens`
    # [positions] int64, index into `tokens` of the logits of each position rejection reads:
    # row r's positions 0..verify[r], one after the other, row after row
    positions: torch.Tensor
    first: torch.Tensor  # [batch] int64, where row r's positions start in `positions`
    rows: torch.Tensor  # [positions] int64, the row of each position


class TargetStage(ModelStage):
    """Target model stage; owns the target KV cache and the target generators.

    With `emit_features` it also returns its features for a draft head (`StepOutputs.
    target_features`): the last block's output after the final norm at every token it ran and
    kept (each row's pending inputs, then its accepted drafts), so the forward keeps the output
    at every token, not only where rejection reads. On llama.cpp's engine they are its
    embeddings output (`GGUFModel.features`, a context made with `EngineSettings.features`).
    """

    SALT = TARGET_SALT

    def __init__(self, *args: Any, emit_features: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        model = self.model
        if emit_features and not isinstance(model, Transformer) and not model.settings.features:
            raise ValueError(
                "emit_features (a draft head's input) needs the target on the torch runtime, or "
                "on llama.cpp's engine with EngineSettings.features"
            )
        self.emit_features = emit_features

    @torch.inference_mode()
    def __call__(
        self,
        inputs: StepInputs,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor,
        num_verify: torch.Tensor,
    ) -> StepOutputs:
        """Verify and sample one step.

        draft_tokens: [batch, K] int, draft_probs: [batch, P, vocab_width] (the warped q of the
        first P positions, 1 <= P <= K: the draft stage sends only the positions any row may
        draft; `vocab_limit` wide when set, else the target's rows),
        num_verify: [batch] int, admitted prefix per row (<= num_draft_tokens and <= P).

        Host reads, once per step and by design: num_verify (to pack the ragged batch) and
        num_accepted (to roll the cache back); the verifier itself never syncs.
        """
        started = time.perf_counter()
        k, vocab = self.max_draft_tokens, self.vocab_width
        step = read_step_inputs(inputs, k, check=self.check_values)  # checked by the draft
        if self.check_values:
            verify = check_verify_inputs(step, k, vocab, draft_tokens, draft_probs, num_verify)
        else:
            verify = num_verify.tolist()
        offsets = self.slots.prepare(step)
        if inputs.batch_size == 0:
            empty = torch.zeros(0, dtype=torch.int32, device=self.device)
            return StepOutputs(empty.reshape(0, k + 1), empty, empty)
        draft_tokens = draft_tokens.to(self.device)
        num_verify = num_verify.to(self.device, torch.int32)
        packed = pack_verify_batch(
            inputs.input_ids, offsets, step.input_lengths, draft_tokens, verify
        )
        # the last block's output at the positions rejection may read; the output layer and the
        # warp run on the positions it does read (`_probs_at`)
        every = None if self.emit_features else packed.positions
        ran = self.forward_cached(step.seq_ids, packed.tokens, packed.lengths, at=every)
        hidden = ran if every is not None else ran[packed.positions]
        logits = OutputLayer(self.model, hidden, packed, num_verify, self.mask_vocab)
        probs_at = partial(
            self._probs_at,
            logits,
            inputs.temperature.to(self.device, torch.float32)[packed.rows],
            inputs.top_p.to(self.device, torch.float32)[packed.rows],
        )
        output_ids, num_accepted = self._reject(
            step, draft_tokens, draft_probs, probs_at, packed, num_verify
        )
        accepted = self._roll_back(step, num_accepted)  # a host read: the step's work is done
        outputs = StepOutputs(output_ids, num_accepted, num_verify)
        if self.emit_features:
            self._features(outputs, ran, step, offsets, packed, accepted, verify)
        outputs.target_ms = torch.tensor([(time.perf_counter() - started) * 1e3])
        return outputs

    def _features(
        self, outputs: StepOutputs, hidden: torch.Tensor, step: HostStep, offsets: list[int],
        packed: VerifyBatch, accepted: list[int], verify: list[int],
    ) -> None:  # fmt: skip
        """Fill `outputs`' target_features, feature_counts and feature_starts from the last
        block's output at every packed token `hidden` [tokens, width]."""
        counts = [n - v + a for n, v, a in zip(packed.lengths, verify, accepted, strict=True)]
        starts = [s + o for s, o in zip(step.start_positions, offsets, strict=True)]
        row_start = itertools.accumulate(packed.lengths, initial=0)
        index = torch.cat(
            [torch.arange(r, r + c) for r, c in zip(row_start, counts, strict=False)]
        ).to(hidden.device)
        outputs.target_features = _final_norm_rows(self.model, hidden, index)
        outputs.feature_counts = torch.tensor(counts, dtype=torch.int32)
        outputs.feature_starts = torch.tensor(starts, dtype=torch.int32)

    def _probs_at(
        self,
        logits: OutputLayer,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """The warped p [n, vocab_width] at packed positions [n] (`logits` gives their logits;
        temperature and top_p are given position by position).

        The padded rows past `vocab_limit` (p = 0 after masking) are dropped.
        """
        probs = warp_probs(
            logits(positions)[:, None],  # [n, 1, vocab]
            temperature[positions],
            top_p[positions],
            check_values=self.check_values,
        )
        return probs[:, 0, : self.vocab_width]

    def _reject(
        self,
        step: HostStep,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor,
        probs_at: Callable[[torch.Tensor], torch.Tensor],
        packed: VerifyBatch,
        num_verify: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection-sample every row with its own generator: (output_ids [batch, K + 1],
        num_accepted).

        On the CPU depth by depth (`rejection_sample` given `probs_at`: p at a row's accepted
        drafts and the position its token is drawn at, not at every verified one); elsewhere from p
        at every verified position in one pass. q stays in its dtype: rejection reads it at the
        drafts and one position per row only. With q for P < K positions the test runs on those
        P (nothing past them is verified) and draws K + 1 uniforms a row all the same, so a
        request's random stream never depends on how far the other rows of its batch could
        draft; output_ids is padded back to K + 1.
        """
        k, width = draft_tokens.shape[1], draft_probs.shape[1]
        target_probs: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
        if self.by_depth:
            target_probs = probs_at
        else:
            target_probs = probs_at(torch.arange(len(packed.positions), device=self.device))
        output_ids, num_accepted = rejection_sample(
            draft_tokens[:, :width],
            draft_probs.to(self.device),
            target_probs,
            num_verify,
            RequestStreams(self.slots.generators(step.seq_ids), positions=k),
            first_position=packed.first,
            check_values=self.check_values,
        )
        if width < k:
            output_ids = torch.nn.functional.pad(output_ids, (0, k - width), value=-1)
        return output_ids, num_accepted

    @property
    def by_depth(self) -> bool:
        """Warp depth by depth (a host read per depth, of which rows go on): CPU only."""
        return self.device.type == "cpu"

    def _roll_back(self, step: HostStep, num_accepted: torch.Tensor) -> list[int]:
        """Keep each row's committed inputs and accepted drafts cached; drop the rest. Returns
        num_accepted read to the host."""
        accepted = num_accepted.tolist()
        for r, seq_id in enumerate(step.seq_ids):
            committed = step.start_positions[r] + step.input_lengths[r]
            self.cache.rollback(seq_id, committed + accepted[r])
        return accepted


# Below about this many rows a CPU product with the target's output matrix costs what streaming
# the matrix from memory costs (measured on the default pair, bf16, 49,152 x 576: 8.5 ms, then
# 0.37 ms a row), so `OutputLayer` then computes a few depths of the same rows at once.
OUTPUT_LAYER_ROWS = 24


class OutputLayer:
    """The target's logits at packed positions of one step, computed when first asked for.

    `hidden` [positions, width]: the last block's output at every position the step may read.
    Asked for n positions it has not computed, it computes them and, for the same rows, the
    next `ceil(OUTPUT_LAYER_ROWS / n) - 1` depths (within each row's num_verify) in the same
    product: one product of 64 rows is one depth, a lone row's every depth is one product.
    When at most OUTPUT_LAYER_ROWS positions would be left after that, the product takes them
    too: a product of their own would cost a whole stream of the matrix. A step in which 6 of 64
    rows verify one draft each is then one product of 70 rows, 25.1 ms, not 64 rows and then 6,
    23.4 + 8.5 ms (the default pair's output layer, bf16, 1 thread).
    Which products compute a logit changes no value it is asked for, only the time.
    """

    def __init__(
        self,
        model: StageModel,
        hidden: torch.Tensor,
        packed: VerifyBatch,
        num_verify: torch.Tensor,
        mask_vocab: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        self.model, self.hidden, self.mask_vocab = model, hidden, mask_vocab
        self.rows = packed.rows
        self.last = packed.first + num_verify.long()  # each row's last position (the bonus's)
        self.done = torch.zeros(len(packed.rows), dtype=torch.bool, device=hidden.device)
        self.logits: torch.Tensor | None = None  # [positions, vocab], written as computed

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """Logits [n, vocab] at packed positions [n] int64 (vocab_limit masked)."""
        missing = positions[~self.done[positions]]
        if len(missing):
            window = -(-OUTPUT_LAYER_ROWS // len(missing))  # depths per row in this product
            ahead = missing[:, None] + torch.arange(window, device=missing.device)
            ahead = ahead[ahead <= self.last[self.rows[missing]][:, None]]
            ahead = ahead[~self.done[ahead]]
            rest = (~self.done).nonzero()[:, 0]
            if len(rest) - len(ahead) <= OUTPUT_LAYER_ROWS:
                ahead = rest  # the few left cost less in this product than in one of their own
            computed = self.mask_vocab(self.model.logits(self.hidden[ahead]))
            if self.logits is None and len(ahead) == len(self.done):
                # every position at once (the one-pass form): `missing` is sorted and the rows'
                # positions are packed in order, so `ahead` is 0..positions-1
                self.logits = computed
            else:
                if self.logits is None:
                    self.logits = computed.new_empty(len(self.done), computed.shape[-1])
                self.logits[ahead] = computed
            self.done[ahead] = True
        assert self.logits is not None
        return self.logits[positions]


def check_verify_inputs(
    step: HostStep,
    max_draft_tokens: int,
    vocab: int,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_verify: torch.Tensor,
) -> list[int]:
    """Check the drafts' shapes (draft_probs [batch, P, vocab], 1 <= P <= K) and 0 <= num_verify
    <= min(num_draft_tokens, P); return num_verify."""
    batch, k = len(step.seq_ids), max_draft_tokens
    check_shape("draft_tokens", draft_tokens, (batch, k))
    check_shape("draft_probs", draft_probs, (batch, None, vocab))
    width = draft_probs.shape[1]
    if not 1 <= width <= k:
        raise ValueError(f"draft_probs has {width} positions, want 1..{k} (max_draft_tokens)")
    check_shape("num_verify", num_verify, (batch,))
    verify = num_verify.tolist()
    for r in range(batch):
        if not 0 <= verify[r] <= step.num_draft_tokens[r]:
            raise ValueError(
                f"num_verify[{r}] = {verify[r]} outside 0..num_draft_tokens "
                f"({step.num_draft_tokens[r]})"
            )
        if verify[r] > width:
            raise ValueError(
                f"num_verify[{r}] = {verify[r]} past the {width} positions of draft_probs"
            )
    return verify


def pack_verify_batch(
    input_ids: torch.Tensor,
    offsets: Sequence[int],
    input_lengths: Sequence[int],
    draft_tokens: torch.Tensor,
    verify: Sequence[int],
) -> VerifyBatch:
    """Pack row r's input_ids[r, offsets[r]:input_lengths[r]] then its first verify[r] drafts.

    input_ids: [batch, position] int, draft_tokens: [batch, K] int (on the model's device).
    Row r, position j (0..verify[r]: the drafts it verifies and the bonus position) reads the
    logits at its token pending - 1 + j; no other position is read.
    """
    batch = draft_tokens.shape[0]
    device = draft_tokens.device
    pending = [n - o for n, o in zip(input_lengths, offsets, strict=True)]
    tokens = torch.cat(
        [
            torch.cat(
                (
                    input_ids[r, offsets[r] : input_lengths[r]].to(device),
                    draft_tokens[r, : verify[r]],
                )
            )
            for r in range(batch)
        ]
    ).long()  # [tokens]
    lengths = [p + v for p, v in zip(pending, verify, strict=True)]
    row_start = [0, *itertools.accumulate(lengths)][:batch]
    positions = [
        row_start[r] + pending[r] - 1 + j for r in range(batch) for j in range(verify[r] + 1)
    ]
    first = [0, *itertools.accumulate(v + 1 for v in verify)][:batch]
    rows = [r for r in range(batch) for _ in range(verify[r] + 1)]
    return VerifyBatch(
        tokens,
        lengths,
        torch.tensor(positions, dtype=torch.int64, device=device),
        torch.tensor(first, dtype=torch.int64, device=device),
        torch.tensor(rows, dtype=torch.int64, device=device),
    )


def _final_norm_rows(model: StageModel, ran: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The final norm's output [len(index), width] float32 at packed tokens `index`: the torch
    runtime's from the last block's output `ran`, llama.cpp's from its embeddings output."""
    if isinstance(model, Transformer):
        return model.final_norm(ran[index]).float()
    return model.features()[index.cpu()].float()
