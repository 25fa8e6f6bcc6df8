"""The TensorRT-LLM target of a speculative step: one external-draft request per sequence.

A TensorRT-LLM engine built with `--speculative_decoding_mode=draft_tokens_external` verifies
drafts handed to it per request: `draft_input_ids` (the drafts) and, for probabilistic acceptance,
`draft_logits` (the draft distribution q the drafts were sampled from). Its batch manager batches
requests in flight by itself, so a speculative step of `batch` sequences becomes `batch` requests
(fan-out) whose answers are put back in batch order (gather). The verifier's batch-level decision
is made before the fan-out and travels as each request's draft list: a sequence's request carries
exactly its first `num_verify` drafts, so the engine can neither verify a trimmed draft nor
re-decide the budget.

Per sequence, with v = num_verify and d = the drafts:

- `input_ids` = the whole committed context (the engine keeps no state between our requests; its
  KV-cache block reuse recovers the shared prefix), `request_output_len` = v + 1;
- `draft_input_ids` = d[:v] (omitted when v = 0);
- `draft_logits` = log q[:v] (sampled requests only, and only with `use_draft_logits`): the
  engine softmaxes them without temperature, so log q gives back q exactly; zeros map to
  LOG_ZERO, which the fp32 softmax turns into exact zeros;
- greedy (temperature 0) = `runtime_top_k` 1; sampled = the request's temperature and top-p;
- `random_seed` = a hash of (the sequence's seed, its committed length): every step of a sequence
  gets fresh randomness, and a replayed step the same randomness.

`end_id` is deliberately not sent: the entry model's scheduler owns stopping (EOS, max_tokens), and
an engine that stopped on EOS would drop the EOS token from its output.

Reading the answer: accepted drafts come back unchanged and the token after them differs from the
draft at that position (a rejected draft x has p(x) < q(x), so the residual max(0, p - q) gives x
no mass; greedy and token-matching corrections differ by construction). So num_accepted = the
first position where the output leaves the drafts, and the sequence gains output[: a + 1]. Tokens
the engine generated past that point (it may continue to request_output_len after a rejection)
are discarded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from avspec.checks import check_same_device, check_shape

LOG_ZERO = -1.0e4  # exp(LOG_ZERO - max) underflows to exactly 0 in fp32
_MASK64 = (1 << 64) - 1


@dataclass(frozen=True)
class TensorSpec:
    """A tensor of the tensorrt_llm model: numpy dtype and config `dims` (batch dim excluded)."""

    name: str
    dtype: type
    dims: tuple[int, ...]
    optional: bool = False


# What the adapter sends and reads; names and dtypes follow the tensorrtllm backend's
# `tensorrt_llm` model (its config.pbtxt; max_batch_size > 0, so every tensor gets a batch dim 1).
TRTLLM_INPUTS: dict[str, TensorSpec] = {
    s.name: s
    for s in (
        TensorSpec("input_ids", np.int32, (-1,)),
        TensorSpec("input_lengths", np.int32, (1,)),
        TensorSpec("request_output_len", np.int32, (1,)),
        TensorSpec("draft_input_ids", np.int32, (-1,), optional=True),
        TensorSpec("draft_logits", np.float32, (-1, -1), optional=True),
        TensorSpec("temperature", np.float32, (1,), optional=True),
        TensorSpec("runtime_top_k", np.int32, (1,), optional=True),
        TensorSpec("runtime_top_p", np.float32, (1,), optional=True),
        TensorSpec("random_seed", np.uint64, (1,), optional=True),
        TensorSpec("streaming", np.bool_, (1,), optional=True),
    )
}
TRTLLM_OUTPUTS: dict[str, TensorSpec] = {
    s.name: s
    for s in (
        TensorSpec("output_ids", np.int32, (-1, -1)),  # [beam, tokens]
        TensorSpec("sequence_length", np.int32, (-1,)),  # [beam]
    )
}


def step_seed(random_seed: int, position: int) -> int:
    """A 64-bit seed for one step of a sequence: splitmix64 of (seed, committed length)."""
    z = (random_seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


class ContextLedger:
    """Committed tokens of every live sequence (host-side): the engine needs the whole context.

    Follows the step contract: `input_ids[:input_length]` are committed tokens starting at
    `start_position`; anything cached past that point (a previous step's rejected tail) is cut.
    """

    def __init__(self, max_sequences: int, max_length: int) -> None:
        if max_sequences < 1 or max_length < 1:
            raise ValueError(
                f"max_sequences and max_length must be >= 1, got {max_sequences}, {max_length}"
            )
        self.max_sequences = max_sequences
        self.max_length = max_length
        self._tokens: dict[int, list[int]] = {}

    @property
    def num_live(self) -> int:
        return len(self._tokens)

    def context(self, seq_id: int) -> list[int]:
        """A copy of the committed tokens of `seq_id` (KeyError if unknown)."""
        return list(self._tokens[seq_id])

    def release(self, seq_ids: Sequence[int]) -> None:
        """Forget finished sequences (unknown ids are ignored: releases may repeat)."""
        for seq_id in seq_ids:
            self._tokens.pop(int(seq_id), None)

    def update(
        self,
        seq_ids: torch.Tensor,
        input_ids: torch.Tensor,
        input_lengths: torch.Tensor,
        start_positions: torch.Tensor,
    ) -> list[list[int]]:
        """Append each row's new committed tokens; return the contexts in batch order.

        seq_ids [batch] int, input_ids [batch, seq] int, input_lengths [batch] int (1..seq),
        start_positions [batch] int (0 for a new sequence, at most the known length). Host-side:
        the tensors are read with `.tolist()`. Bad input raises ValueError before any change.
        """
        batch = seq_ids.shape[0] if seq_ids.dim() == 1 else -1
        check_shape("seq_ids", seq_ids, (None,))
        check_shape("input_ids", input_ids, (batch, None))
        check_shape("input_lengths", input_lengths, (batch,))
        check_shape("start_positions", start_positions, (batch,))
        ids, rows = seq_ids.tolist(), input_ids.tolist()
        lengths, starts = input_lengths.tolist(), start_positions.tolist()
        if len(set(ids)) != len(ids):
            raise ValueError(f"seq_ids must be distinct, got {ids}")
        new = [i for i in ids if i not in self._tokens]
        if len(self._tokens) + len(new) > self.max_sequences:
            raise ValueError(
                f"{len(self._tokens) + len(new)} live sequences exceed max_sequences "
                f"{self.max_sequences}"
            )
        for seq_id, row, length, start in zip(ids, rows, lengths, starts, strict=True):
            known = len(self._tokens.get(seq_id, ()))
            if not 1 <= length <= len(row):
                raise ValueError(f"seq {seq_id}: input_length {length} outside 1..{len(row)}")
            if not 0 <= start <= known:
                raise ValueError(f"seq {seq_id}: start_position {start} outside 0..{known}")
            if start + length > self.max_length:
                raise ValueError(f"seq {seq_id}: {start + length} tokens exceed {self.max_length}")
        contexts = []
        for seq_id, row, length, start in zip(ids, rows, lengths, starts, strict=True):
            tokens = self._tokens.get(seq_id, [])[:start] + row[:length]
            self._tokens[seq_id] = tokens
            contexts.append(list(tokens))
        return contexts


@dataclass
class TargetRequest:
    """One sequence's request to the tensorrt_llm model.

    `host` holds the small tensors as numpy arrays with a leading batch dim of 1; `draft_logits`
    ([1, num_verify, vocab] fp32, on the draft's device) is None when not sent.
    """

    seq_id: int
    host: dict[str, np.ndarray]
    draft_logits: torch.Tensor | None
    drafts: list[int]  # the num_verify drafts sent


def draft_log_probs(draft_probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """log q [batch, position, vocab_size] fp32 from q [batch, position, vocab] (vocab <= size).

    Zero probabilities and the padded tail of the vocabulary become LOG_ZERO. Stays on q's device.
    """
    check_shape("draft_probs", draft_probs, (None, None, None))
    vocab = draft_probs.shape[-1]
    if vocab > vocab_size:
        raise ValueError(f"draft vocabulary {vocab} is larger than the engine's {vocab_size}")
    logs = torch.log(draft_probs.float()).clamp_min(LOG_ZERO)
    return torch.nn.functional.pad(logs, (0, vocab_size - vocab), value=LOG_ZERO)


@dataclass(frozen=True)
class RowSampling:
    """Each row's sampling settings, as the step contract carries them: `temperature` and
    `top_p` [batch] fp (temperature 0: greedy), `random_seed` [batch] int."""

    temperature: torch.Tensor
    top_p: torch.Tensor
    random_seed: torch.Tensor


def build_requests(
    seq_ids: torch.Tensor,
    contexts: Sequence[Sequence[int]],
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    num_verify: torch.Tensor,
    sampling: RowSampling,
    vocab_size: int,
    use_draft_logits: bool = True,
) -> list[TargetRequest]:
    """One TargetRequest per sequence, in batch order (see the module docstring for the rules).

    seq_ids [batch] int, contexts: batch lists of committed tokens, draft_tokens [batch, K] int,
    draft_probs [batch, K, vocab] fp (device), num_verify [batch] int in 0..K, `sampling` the
    rows' temperature, top_p and seed. Host-side: everything but draft_probs is read to the host
    once (the fan-out needs each row's lengths); draft_probs is sliced on its device.
    """
    temperature, top_p, random_seed = sampling.temperature, sampling.top_p, sampling.random_seed
    batch = len(contexts)
    check_shape("seq_ids", seq_ids, (batch,))
    check_shape("draft_tokens", draft_tokens, (batch, None))
    k = draft_tokens.shape[1]
    check_shape("draft_probs", draft_probs, (batch, k, None))
    for name, t in (("num_verify", num_verify), ("temperature", temperature), ("top_p", top_p)):
        check_shape(name, t, (batch,))
    check_shape("random_seed", random_seed, (batch,))
    check_same_device(draft_tokens=draft_tokens, draft_probs=draft_probs)
    verify = num_verify.tolist()
    if any(not 0 <= v <= k for v in verify):
        raise ValueError(f"num_verify must lie in 0..{k}, got {verify}")
    if any(len(c) == 0 for c in contexts):
        raise ValueError("every context must hold at least one token")
    temps, tops, seeds = temperature.tolist(), top_p.tolist(), random_seed.tolist()
    drafts = draft_tokens.tolist()
    logs = draft_log_probs(draft_probs, vocab_size) if use_draft_logits else None
    requests = []
    for row, seq_id in enumerate(seq_ids.tolist()):
        v, context, greedy = verify[row], contexts[row], temps[row] == 0.0
        host: dict[str, np.ndarray] = {
            "input_ids": np.asarray([context], dtype=np.int32),
            "input_lengths": np.asarray([[len(context)]], dtype=np.int32),
            "request_output_len": np.asarray([[v + 1]], dtype=np.int32),
            "temperature": np.asarray([[1.0 if greedy else temps[row]]], dtype=np.float32),
            "runtime_top_k": np.asarray([[1 if greedy else 0]], dtype=np.int32),
            "runtime_top_p": np.asarray([[1.0 if greedy else tops[row]]], dtype=np.float32),
            "random_seed": np.asarray([[step_seed(seeds[row], len(context))]], dtype=np.uint64),
            "streaming": np.asarray([[False]], dtype=np.bool_),
        }
        sent = drafts[row][:v]
        if v:
            host["draft_input_ids"] = np.asarray([sent], dtype=np.int32)
        logits = logs[row : row + 1, :v] if (logs is not None and v and not greedy) else None
        requests.append(TargetRequest(int(seq_id), host, logits, sent))
    return requests


def parse_response(
    output_ids: np.ndarray, sequence_length: np.ndarray, drafts: Sequence[int]
) -> tuple[list[int], int]:
    """(tokens gained, num_accepted) from one tensorrt_llm answer (input excluded from output).

    output_ids [1, beam, tokens] int, sequence_length [1, beam] int; beam 0 is read. The tokens
    gained are the accepted drafts then one correction or bonus token.
    """
    output_ids, sequence_length = np.asarray(output_ids), np.asarray(sequence_length)
    if output_ids.ndim != 3 or output_ids.shape[:2] != sequence_length.shape[:2]:
        raise ValueError(
            f"output_ids must be [1, beam, tokens] and sequence_length [1, beam], got "
            f"{output_ids.shape} and {sequence_length.shape}"
        )
    if output_ids.shape[0] != 1 or output_ids.shape[1] < 1:
        raise ValueError(f"expected one request with beam >= 1, got {output_ids.shape}")
    length = int(sequence_length[0, 0])
    if not 1 <= length <= output_ids.shape[2]:
        raise ValueError(f"sequence_length {length} outside 1..{output_ids.shape[2]}")
    tokens = [int(t) for t in output_ids[0, 0, :length]]
    accepted = 0
    while accepted < min(len(drafts), len(tokens)) and tokens[accepted] == drafts[accepted]:
        accepted += 1
    if accepted == len(tokens):
        raise ValueError(
            f"target returned {len(tokens)} token(s), all equal to the drafts: no correction or "
            f"bonus token (engine stopped early?)"
        )
    return tokens[: accepted + 1], accepted


def gather_outputs(
    results: Sequence[tuple[Sequence[int], int]], max_draft_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Stack per-sequence (tokens, num_accepted) into the step contract's target outputs.

    Returns output_ids [batch, K + 1] int32 (padded with 0) and num_accepted [batch] int32.
    """
    output_ids = torch.zeros(len(results), max_draft_tokens + 1, dtype=torch.int32)
    num_accepted = torch.zeros(len(results), dtype=torch.int32)
    for row, (tokens, accepted) in enumerate(results):
        if len(tokens) != accepted + 1 or accepted > max_draft_tokens:
            raise ValueError(
                f"row {row}: {len(tokens)} tokens with num_accepted {accepted} (K = "
                f"{max_draft_tokens})"
            )
        output_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.int32)
        num_accepted[row] = accepted
    return output_ids, num_accepted
