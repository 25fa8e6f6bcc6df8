"""The llama.cpp engine's model and KV pool on the real SmolLM2 GGUF.

- Logits of a packed ragged batch equal each sequence decoded alone (bit for bit: one shape per
  sequence here, and ggml's sums over one sequence's cells do not depend on the others').
- Roll-back: positions of a rejected draft never reach the next step. A sequence that appends
  prompt + 3 drafts, keeps 1 and appends the next token has, bit for bit, the logits of one fed
  prompt + that draft, then the token (each in a fresh context, so both pools lay out their
  cells alike: ggml's one-token attention sums over the pool's cell range, and another layout
  moves these logits by up to about 0.5). A pool whose roll-back is off by one either way (the
  deliberate faults) is caught: llama.cpp refuses positions that do not follow the sequence's
  cache, and the engine raises.
- Limits: a sequence past `max_length`, a pool past its cells, more sequences than the context
  holds: `CacheLimitError` before anything runs, and the pool is unchanged afterwards.
- Bad files: missing, truncated, not Llama-family: `GGUFError` naming the file.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from avspec.runtime.gguf.reader import GGUFError
from avspec.runtime.kv_cache import CacheLimitError
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.llamacpp.sequences import SequencePool

PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308]
DRAFTS = [504, 3575, 282]
NEXT = 4649
TOLERANCE = 1e-4  # measured: 0


SETTINGS = EngineSettings(max_sequences=4, pool_tokens=256, max_outputs=64, threads=2)


@pytest.fixture(scope="module")
def model(smollm2_gguf: Path) -> GGUFModel:
    return GGUFModel(smollm2_gguf, SETTINGS)


@pytest.fixture
def pool(model: GGUFModel) -> SequencePool:
    pool = model.new_cache(max_length=64)
    yield pool
    for seq_id in pool.live_ids():
        pool.free(seq_id)


def ids(tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64)


def alone(model: GGUFModel, pool: SequencePool, tokens: list[int], seq_id: int) -> torch.Tensor:
    """Logits at the last token of `tokens` fed to a fresh sequence, then freed."""
    pool.allocate(seq_id)
    out = model.forward_cached(
        pool, [seq_id], ids(tokens), [len(tokens)], at=ids([len(tokens) - 1])
    )
    out = out.clone()
    pool.free(seq_id)
    return out[0]


def test_ragged_batch_equals_each_sequence_alone(model, pool) -> None:
    a, b = PROMPT, PROMPT[:5] + DRAFTS
    pool.allocate(10), pool.allocate(20)
    packed = model.forward_cached(
        pool, [10, 20], ids(a + b), [len(a), len(b)], at=ids([len(a) - 1, len(a) + len(b) - 1])
    ).clone()
    assert packed.shape == (2, model.vocab_size)
    assert pool.length(10) == len(a) and pool.length(20) == len(b)
    assert (packed[0] - alone(model, pool, a, 30)).abs().max() <= TOLERANCE
    assert (packed[1] - alone(model, pool, b, 30)).abs().max() <= TOLERANCE


class OffByOnePool(SequencePool):
    """The deliberate fault: roll-back removes from `length + shift` while the books say
    `length` (shift 1: a rejected draft stays cached; -1: an accepted one is lost)."""

    shift = 1

    def rollback(self, seq_id: int, length: int) -> None:
        held = self._lengths[int(seq_id)]
        super().rollback(seq_id, min(max(length + self.shift, 0), held))
        self._lengths[int(seq_id)] = int(length)


def next_logits(path: Path, first: list[int], keep: int | None, shift: int | None = None):
    """Logits of NEXT after `first` (rolled back to `keep`), in a fresh context."""
    model = GGUFModel(path, SETTINGS)
    pool = model.new_cache(max_length=64)
    if shift is not None:
        pool = OffByOnePool(pool.memory, pool.binding, 4, pool.pool_tokens, pool.max_length)
        pool.shift = shift
    pool.allocate(1)
    model.forward_cached(pool, [1], ids(first), [len(first)])
    if keep is not None:
        pool.rollback(1, keep)
    return model.forward_cached(pool, [1], ids([NEXT]), [1]).clone()[0]


@pytest.mark.parametrize("shift", [None, 1, -1], ids=["pool", "keeps one more", "keeps one less"])
def test_rejected_positions_never_reach_the_next_step(smollm2_gguf, shift: int | None) -> None:
    expected = next_logits(smollm2_gguf, PROMPT + DRAFTS[:1], None)
    if shift is None:
        actual = next_logits(smollm2_gguf, PROMPT + DRAFTS, len(PROMPT) + 1)
        assert torch.equal(actual, expected)
        return
    with pytest.raises(RuntimeError, match="positions"):
        next_logits(smollm2_gguf, PROMPT + DRAFTS, len(PROMPT) + 1, shift)


def test_limits_refuse_before_running(smollm2_gguf) -> None:
    model = GGUFModel(smollm2_gguf, SETTINGS)
    pool = model.new_cache(max_length=64)
    pool.allocate(5)
    model.forward_cached(pool, [5], ids(PROMPT), [len(PROMPT)])
    with pytest.raises(CacheLimitError, match="max_length 64"):
        model.forward_cached(pool, [5], ids([NEXT] * 60), [60])
    pool.pool_tokens = len(PROMPT) + 8  # as if the pool had only this many cells
    with pytest.raises(CacheLimitError, match="KV pool is full"):
        model.forward_cached(pool, [5], ids([NEXT] * 9), [9])
    for seq_id in range(6, 9):
        pool.allocate(seq_id)
    with pytest.raises(CacheLimitError, match="4 sequences"):
        pool.allocate(9)
    with pytest.raises(ValueError, match="max_outputs"):
        model.forward_cached(pool, [6], ids([NEXT] * 65), [65])
    assert pool.length(5) == len(PROMPT) and pool.length(6) == 0
    # after every refusal the sequence goes on where it was
    after = model.forward_cached(pool, [5], ids([NEXT]), [1]).clone()[0]
    assert torch.equal(after, next_logits(smollm2_gguf, PROMPT, None))


def test_bad_files_are_refused_by_name(tmp_path: Path, smollm2_gguf: Path) -> None:
    settings = EngineSettings(max_sequences=1, pool_tokens=64, max_outputs=8)
    with pytest.raises(GGUFError, match="no such GGUF file"):
        GGUFModel(tmp_path / "missing.gguf", settings)
    data = smollm2_gguf.read_bytes()
    for cut in (1 << 20, len(data) - 4096):  # in the metadata; in the last tensor's data
        truncated = tmp_path / f"truncated-{cut}.gguf"
        truncated.write_bytes(data[:cut])
        with pytest.raises(GGUFError, match=truncated.name):
            GGUFModel(truncated, settings)
    foreign = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(foreign, "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match="'gpt2' is not supported"):
        GGUFModel(foreign, settings)
