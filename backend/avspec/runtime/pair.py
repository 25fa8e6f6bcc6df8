"""Check that a draft and a target model can be paired for speculative decoding.

Speculative decoding compares the two models' distributions token by token, so both must mean
the same thing by every id and stop on the same ids. `check_pair` enforces, on host data only
(tokenizers and the embedding row counts from the configs, no weights):

- **Same vocabulary:** the token-to-id map is the same over the tokenizers' range, and the ranges
  are equal (a token only one model knows could be proposed or emitted without the other being
  able to read it).
- **Same EOS ids** (`HFTokenizer.eos_ids`, the union of the ids the configs name).
- **Embedding rows may be padded** past the tokenizer's size (Qwen2.5-7B has 152064 rows,
  Qwen2.5-0.5B 151936, for 151665 tokens): that is allowed, and `PairInfo.num_tokens` tells the
  caller where the real tokens end, so it masks logits from there on to -inf in both models. A
  model with fewer rows than its tokenizer has tokens is refused.

A failed check raises `PairError` (a `ValueError`) with one message naming both directories and,
for a vocabulary mismatch, the first differing token id with its string in each model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from avspec.runtime.hf_tokenizer import HFTokenizer


class PairError(ValueError):
    """The draft and target models cannot be paired."""


@dataclass(frozen=True)
class PairInfo:
    """What a checked pair shares and how its logits are masked."""

    num_tokens: int
    """Real tokens: ids 0..num_tokens-1; logits at num_tokens and past are set to -inf."""
    eos_ids: frozenset[int]
    draft_vocab_rows: int
    target_vocab_rows: int

    @property
    def padded(self) -> bool:
        """Whether either model has embedding rows past the real tokens (logits to mask)."""
        return max(self.draft_vocab_rows, self.target_vocab_rows) > self.num_tokens


def check_pair(
    draft_dir: Path | str,
    target_dir: Path | str,
    draft_tokenizer: HFTokenizer,
    target_tokenizer: HFTokenizer,
    draft_vocab_rows: int,
    target_vocab_rows: int,
) -> PairInfo:
    """Check that the draft and target share vocabulary and EOS; see the module docstring.

    `*_vocab_rows` is each model's embedding (and output layer) row count, `vocab_size` in its
    `config.json`. Raises `PairError` for a pair that cannot be served together.
    """
    pair = f"draft {draft_dir} and target {target_dir}"
    for role, directory, tokenizer, rows in (
        ("draft", draft_dir, draft_tokenizer, draft_vocab_rows),
        ("target", target_dir, target_tokenizer, target_vocab_rows),
    ):
        if rows < tokenizer.vocab_size:
            raise PairError(
                f"{pair} cannot be paired: the {role} {directory} has {rows} embedding rows "
                f"but its tokenizer has {tokenizer.vocab_size} tokens"
            )
    draft_tokens, target_tokens = draft_tokenizer.tokens, target_tokenizer.tokens
    if draft_tokens != target_tokens:
        first = next(
            (
                i
                for i, (d, t) in enumerate(zip(draft_tokens, target_tokens, strict=False))
                if d != t
            ),
            min(len(draft_tokens), len(target_tokens)),
        )
        raise PairError(
            f"{pair} do not share a vocabulary: token id {first} is "
            f"{_shown(draft_tokenizer.token(first))} in the draft and "
            f"{_shown(target_tokenizer.token(first))} in the target "
            f"(tokenizer sizes {draft_tokenizer.vocab_size} and {target_tokenizer.vocab_size})"
        )
    if draft_tokenizer.eos_ids != target_tokenizer.eos_ids:
        raise PairError(
            f"{pair} do not stop on the same EOS ids: {sorted(draft_tokenizer.eos_ids)} in the "
            f"draft, {sorted(target_tokenizer.eos_ids)} in the target"
        )
    return PairInfo(
        num_tokens=target_tokenizer.vocab_size,
        eos_ids=target_tokenizer.eos_ids,
        draft_vocab_rows=draft_vocab_rows,
        target_vocab_rows=target_vocab_rows,
    )


def _shown(token: str | None) -> str:
    return "absent" if token is None else repr(token)
