"""The draft stage of one speculative step: feed pending tokens, then draft K tokens per sequence.

One `forward_cached` call runs every sequence's pending inputs (prefill and decode mixed); the
logits at each sequence's last pending token give draft 0. Then up to K - 1 one-token decode
passes each feed the previous draft of the rows that want more drafts and sample the next one.
The last draft is never fed: if it is accepted, the next step brings it back as an input and the
cache rule (keep `min(cached, start + reusable)`) makes the draft run it then.

Each draft is sampled from the warped draft distribution q (avspec.engine.sampling, same warp as the
target) with the sequence's own generator; the feature is logit(q_max) of the temperature-scaled
logits (avspec.av.features). Positions >= a row's num_draft_tokens are padding: token 0, q = 0,
feature 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from avspec.av.features import logit_qmax
from avspec.contract import StepInputs, read_step_inputs
from avspec.engine.sampling import sample, warp_probs
from avspec.engine.stage import DRAFT_SALT, ModelStage


@dataclass
class DraftOutput:
    """Drafts of one step. Positions past a row's num_draft_tokens are padding."""

    draft_tokens: torch.Tensor  # [batch, K] int32
    draft_probs: torch.Tensor  # [batch, K, vocab] float32, the warped q each draft came from
    draft_features: torch.Tensor  # [batch, K] float32, logit(q_max) per position


class DraftStage(ModelStage):
    """Draft model stage; owns the draft KV cache and the draft generators."""

    SALT = DRAFT_SALT

    @torch.inference_mode()
    def __call__(self, inputs: StepInputs) -> DraftOutput:
        """Release, apply the cache rule, run pending inputs, and draft; see the module doc."""
        step = read_step_inputs(inputs, self.max_draft_tokens)
        offsets = self.slots.prepare(step)
        batch, k, vocab = inputs.batch_size, self.max_draft_tokens, self.model.config.vocab_size
        tokens = torch.zeros(batch, k, dtype=torch.int32, device=self.device)
        probs = torch.zeros(batch, k, vocab, dtype=torch.float32, device=self.device)
        features = torch.zeros(batch, k, dtype=torch.float32, device=self.device)
        if batch == 0:
            return DraftOutput(tokens, probs, features)
        temperature = inputs.temperature.to(self.device, torch.float32)
        top_p = inputs.top_p.to(self.device, torch.float32)
        generators = self.slots.generators(step.seq_ids)

        lengths = [n - o for n, o in zip(step.input_lengths, offsets, strict=True)]
        packed = torch.cat(
            [inputs.input_ids[r, offsets[r] : step.input_lengths[r]] for r in range(batch)]
        ).to(self.device, torch.int64)  # [tokens]
        logits = self.model.forward_cached(self.cache, step.seq_ids, packed, lengths)
        last = torch.tensor(lengths, device=self.device).cumsum(0) - 1  # [batch]
        logits = logits[last]  # [batch, vocab], at each row's last pending token
        rows = list(range(batch))
        for position in range(k):
            rows = [r for r in rows if step.num_draft_tokens[r] > position]
            if not rows:
                break
            index = torch.tensor(rows, device=self.device)  # [rows]
            if position == 0:
                logits = logits[index]
            else:
                previous = tokens[index, position - 1].long()  # [rows]
                seq_ids = [step.seq_ids[r] for r in rows]
                logits = self.model.forward_cached(self.cache, seq_ids, previous, [1] * len(rows))
            draw = _Draw(index, temperature[index], top_p[index], [generators[r] for r in rows])
            self._draft_position(position, draw, logits, tokens, probs, features)
        return DraftOutput(tokens, probs, features)

    def _draft_position(
        self,
        position: int,
        draw: _Draw,
        logits: torch.Tensor,
        tokens: torch.Tensor,
        probs: torch.Tensor,
        features: torch.Tensor,
    ) -> None:
        """Sample draft `position` of the rows in `draw` from logits [rows, vocab]."""
        logits = logits[:, None, :]  # [rows, 1, vocab]
        check = self.check_values
        q = warp_probs(logits, draw.temperature, draw.top_p, check_values=check)[:, 0]
        tokens[draw.index, position] = sample(q, draw.generators, check_values=check).int()
        probs[draw.index, position] = q
        qmax = logit_qmax(logits, draw.temperature, check_values=check)  # [rows, 1]
        features[draw.index, position] = qmax[:, 0]


@dataclass
class _Draw:
    """The rows drafting at one position and their sampling settings."""

    index: torch.Tensor  # [rows] int64, rows of the batch
    temperature: torch.Tensor  # [rows] float32
    top_p: torch.Tensor  # [rows] float32
    generators: list[torch.Generator]
