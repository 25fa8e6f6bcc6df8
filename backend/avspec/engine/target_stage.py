"""The target stage of one speculative step: verify each row's admitted drafts and sample.

One `forward_cached` call runs, per sequence, its pending inputs followed by its first
`num_verify` drafts (a ragged batch). The target distribution at draft position j comes from the
logits one token earlier: position 0 from the last pending input, position j from draft j - 1;
position num_verify gives the bonus token. Only those num_verify + 1 positions per row are
warped like the draft's (avspec.engine.sampling; rejection reads p nowhere else), packed row
after row, p sliced to the stage's `vocab_width` (its `vocab_limit` when set, the width of the
draft's q) and handed to avspec.engine.rejection's packed form: a step's sampling work grows with
the positions it verifies, not with batch x (K + 1). Afterwards the target cache is
rolled back to `start + input_length + num_accepted`: the accepted drafts stay cached (their keys
are exact), rejected drafts go, and the correction/bonus token is not cached (the next step brings
it back as an input). `target_ms` is the stage's host wall time (the cost refresh reads it; the
roll-back reads num_accepted, so on CUDA it includes the device work).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from avspec.checks import check_shape
from avspec.contract import HostStep, StepInputs, StepOutputs, read_step_inputs
from avspec.engine.rejection import packed_rejection_sample
from avspec.engine.sampling import warp_probs
from avspec.engine.stage import TARGET_SALT, ModelStage


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
    """Target model stage; owns the target KV cache and the target generators."""

    SALT = TARGET_SALT

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
        step = read_step_inputs(inputs, k)
        verify = check_verify_inputs(step, k, vocab, draft_tokens, draft_probs, num_verify)
        offsets = self.slots.prepare(step)
        if inputs.batch_size == 0:
            empty = torch.zeros(0, dtype=torch.int32, device=self.device)
            return StepOutputs(empty.reshape(0, k + 1), empty, empty)
        draft_tokens = draft_tokens.to(self.device)
        num_verify = num_verify.to(self.device, torch.int32)
        packed = pack_verify_batch(
            inputs.input_ids, offsets, step.input_lengths, draft_tokens, verify
        )
        target_probs = self._target_probs(inputs, step, packed)
        output_ids, num_accepted = self._reject(
            step, draft_tokens, draft_probs, target_probs, packed.first, num_verify
        )
        self._roll_back(step, num_accepted)  # reads num_accepted: the step's work is done
        target_ms = torch.tensor([(time.perf_counter() - started) * 1e3], dtype=torch.float32)
        return StepOutputs(output_ids, num_accepted, num_verify, target_ms=target_ms)

    def _target_probs(
        self, inputs: StepInputs, step: HostStep, packed: VerifyBatch
    ) -> torch.Tensor:
        """Run the packed batch through the target; return the warped p [positions, width] at
        `packed.positions` (row r's positions 0..num_verify[r] from row packed.first[r]).

        width = `vocab_width`: the padded rows past `vocab_limit` (p = 0 after masking) are dropped.
        """
        # the output layer only at the positions rejection reads: a first step's prompt tokens
        # (hundreds per row) need keys and values, not logits over the whole vocabulary
        logits = self.model.forward_cached(
            self.cache, step.seq_ids, packed.tokens, packed.lengths, at=packed.positions
        )
        probs = warp_probs(
            self.mask_vocab(logits)[:, None],  # [positions, 1, vocab]
            inputs.temperature.to(self.device, torch.float32)[packed.rows],
            inputs.top_p.to(self.device, torch.float32)[packed.rows],
            check_values=self.check_values,
        )
        return probs[:, 0, : self.vocab_width]

    def _reject(
        self,
        step: HostStep,
        draft_tokens: torch.Tensor,
        draft_probs: torch.Tensor,
        target_probs: torch.Tensor,
        first: torch.Tensor,
        num_verify: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rejection-sample every row with its own generator: (output_ids [batch, K + 1],
        num_accepted).

        q stays in its dtype: rejection reads it at the drafts and one position per row only.
        With q for P < K positions the test runs on those P (nothing past them is verified) and
        draws K + 1 uniforms a row all the same, so a request's random stream never depends on
        how far the other rows of its batch could draft; output_ids is padded back to K + 1.
        """
        k, width = draft_tokens.shape[1], draft_probs.shape[1]
        output_ids, num_accepted = packed_rejection_sample(
            draft_tokens[:, :width],
            draft_probs.to(self.device),
            target_probs,
            first,
            num_verify,
            self.slots.generators(step.seq_ids),
            check_values=self.check_values,
            stream_positions=k,
        )
        if width < k:
            output_ids = torch.nn.functional.pad(output_ids, (0, k - width), value=-1)
        return output_ids, num_accepted

    def _roll_back(self, step: HostStep, num_accepted: torch.Tensor) -> None:
        """Keep each row's committed inputs and accepted drafts cached; drop the rest."""
        accepted = num_accepted.tolist()
        for r, seq_id in enumerate(step.seq_ids):
            committed = step.start_positions[r] + step.input_lengths[r]
            self.cache.rollback(seq_id, committed + accepted[r])


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
