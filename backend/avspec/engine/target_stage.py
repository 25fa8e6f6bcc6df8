"""The target stage of one speculative step: verify each row's admitted drafts and sample.

One `forward_cached` call runs, per sequence, its pending inputs followed by its first
`num_verify` drafts (a ragged batch). The target distribution at draft position j comes from the
logits one token earlier: position 0 from the last pending input, position j from draft j - 1;
position num_verify gives the bonus token. Both are warped like the draft's
(avspec.engine.sampling) and handed to avspec.engine.rejection. Afterwards the target cache is
rolled back to `start + input_length + num_accepted`: the accepted drafts stay cached (their keys
are exact), rejected drafts go, and the correction/bonus token is not cached (the next step brings
it back as an input).
"""

from __future__ import annotations

import itertools

import torch

from avspec.checks import check_shape
from avspec.contract import StepInputs, StepOutputs, read_step_inputs
from avspec.engine.rejection import rejection_sample
from avspec.engine.sampling import warp_probs
from avspec.engine.stage import TARGET_SALT, ModelStage


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

        draft_tokens: [batch, K] int, draft_probs: [batch, K, vocab] (the warped q),
        num_verify: [batch] int, admitted prefix per row (<= num_draft_tokens).

        Host reads, once per step and by design: num_verify (to pack the ragged batch) and
        num_accepted (to roll the cache back); the verifier itself never syncs.
        """
        k, vocab = self.max_draft_tokens, self.model.config.vocab_size
        step = read_step_inputs(inputs, k)
        batch = inputs.batch_size
        check_shape("draft_tokens", draft_tokens, (batch, k))
        check_shape("draft_probs", draft_probs, (batch, k, vocab))
        check_shape("num_verify", num_verify, (batch,))
        verify = num_verify.tolist()
        for r in range(batch):
            if not 0 <= verify[r] <= step.num_draft_tokens[r]:
                raise ValueError(
                    f"num_verify[{r}] = {verify[r]} outside 0..num_draft_tokens "
                    f"({step.num_draft_tokens[r]})"
                )
        offsets = self.slots.prepare(step)
        if batch == 0:
            empty = torch.zeros(0, dtype=torch.int32, device=self.device)
            return StepOutputs(empty.reshape(0, k + 1), empty, empty)
        draft_tokens = draft_tokens.to(self.device)
        pending = [n - o for n, o in zip(step.input_lengths, offsets, strict=True)]
        packed = torch.cat(
            [
                torch.cat(
                    (
                        inputs.input_ids[r, offsets[r] : step.input_lengths[r]].to(self.device),
                        draft_tokens[r, : verify[r]],
                    )
                )
                for r in range(batch)
            ]
        ).long()  # [tokens]
        lengths = [p + v for p, v in zip(pending, verify, strict=True)]
        logits = self.model.forward_cached(self.cache, step.seq_ids, packed, lengths)
        # Row r, position j reads the logits at its token pending - 1 + min(j, num_verify);
        # positions past num_verify repeat the bonus position and are ignored by rejection.
        row_start = [0, *itertools.accumulate(lengths)][:batch]
        gather = [
            [row_start[r] + pending[r] - 1 + min(j, verify[r]) for j in range(k + 1)]
            for r in range(batch)
        ]
        target_logits = logits[torch.tensor(gather, device=self.device)]  # [batch, K + 1, vocab]
        target_probs = warp_probs(
            target_logits,
            inputs.temperature.to(self.device, torch.float32),
            inputs.top_p.to(self.device, torch.float32),
            check_values=self.check_values,
        )
        num_verify = num_verify.to(self.device, torch.int32)
        output_ids, num_accepted = rejection_sample(
            draft_tokens,
            draft_probs.to(self.device, torch.float32),
            target_probs,
            num_verify,
            self.slots.generators(step.seq_ids),
            check_values=self.check_values,
        )
        accepted = num_accepted.tolist()
        for r, seq_id in enumerate(step.seq_ids):
            committed = step.start_positions[r] + step.input_lengths[r]
            self.cache.rollback(seq_id, committed + accepted[r])
        return StepOutputs(output_ids, num_accepted, num_verify)
