"""Transformer: config validation, and the cached ragged path against full recomputation."""

from __future__ import annotations

import pytest
import torch

from avspec.runtime.kv_cache import CacheLimitError, KVCache
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights

CONFIG = TransformerConfig(num_layers=2, width=32, num_heads=4, max_length=64)
TOL = 1e-4


def make_model(seed: int = 0) -> Transformer:
    model = Transformer(CONFIG)
    init_weights(model, torch.Generator().manual_seed(seed))
    with torch.no_grad():  # larger weights than the training init, so attention is not uniform
        for p in model.parameters():
            p.mul_(5.0 if p.dim() > 1 else 1.0)
    return model.eval()


class Tracker:
    """Runs forward_cached and keeps each sequence's tokens to recompute it from scratch."""

    def __init__(self, model: Transformer, max_sequences: int = 4) -> None:
        self.model = model
        self.cache = model.new_cache(max_sequences, CONFIG.max_length)
        self.tokens: dict[int, list[int]] = {}
        self.gen = torch.Generator().manual_seed(1)

    def step(self, new: dict[int, int]) -> torch.Tensor:
        """Append `new[seq_id]` random tokens per sequence; check logits; return them."""
        for seq_id in new:
            if not self.cache.has(seq_id):
                self.cache.allocate(seq_id)
                self.tokens[seq_id] = []
        chunks = {s: torch.randint(0, 257, (n,), generator=self.gen) for s, n in new.items()}
        ids = torch.cat(list(chunks.values()))
        with torch.no_grad():
            logits = self.model.forward_cached(self.cache, list(new), ids, list(new.values()))
        offset = 0
        for seq_id, chunk in chunks.items():
            self.tokens[seq_id] += chunk.tolist()
            with torch.no_grad():
                full = self.model(torch.tensor([self.tokens[seq_id]]))[0]
            got = logits[offset : offset + len(chunk)]
            torch.testing.assert_close(got, full[-len(chunk) :], atol=TOL, rtol=0)
            assert self.cache.length(seq_id) == len(self.tokens[seq_id])
            offset += len(chunk)
        return logits

    def rollback(self, seq_id: int, length: int) -> None:
        self.cache.rollback(seq_id, length)
        self.tokens[seq_id] = self.tokens[seq_id][:length]


def test_cached_matches_full_recompute_through_prefill_decode_verify_rollback():
    tracker = Tracker(make_model())
    tracker.step({7: 5, 3: 1, 11: 9})  # ragged prefill
    tracker.step({7: 1, 3: 1, 11: 1})  # one-token decode
    tracker.step({3: 4, 11: 1, 7: 6})  # ragged multi-token verify, reordered batch
    tracker.step({7: 2, 20: 12})  # decode mixed with a new sequence's prefill
    tracker.rollback(7, 9)
    tracker.rollback(11, 10)
    tracker.step({11: 3, 7: 1, 3: 2})  # re-append over rolled-back positions
    tracker.rollback(3, 0)
    tracker.step({3: 4})


def test_ragged_verify_of_a_batch_equals_each_sequence_alone():
    model = make_model(2)
    batch, alone = Tracker(model), Tracker(model)
    prefill = {1: 6, 2: 3, 3: 10}
    batch.step(prefill)
    for seq_id, n in prefill.items():
        alone.step({seq_id: n})
    verify = {1: 5, 2: 1, 3: 3}
    ids = torch.randint(0, 257, (sum(verify.values()),), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        together = model.forward_cached(batch.cache, list(verify), ids, list(verify.values()))
        pieces = []
        for seq_id, chunk in zip(verify, ids.split(list(verify.values())), strict=True):
            pieces.append(model.forward_cached(alone.cache, [seq_id], chunk, [len(chunk)]))
    torch.testing.assert_close(together, torch.cat(pieces), atol=TOL, rtol=0)


def test_forward_cached_errors_leave_the_cache_unchanged():
    model = make_model()
    cache = model.new_cache(2, 16)
    cache.allocate(0)
    ids = torch.zeros(4, dtype=torch.int64)
    with pytest.raises(ValueError, match="not allocated"):
        model.forward_cached(cache, [0, 9], ids, [2, 2])
    with pytest.raises(ValueError, match="shape"):
        model.forward_cached(cache, [0], ids, [3])
    with pytest.raises(ValueError, match="one length >= 1 per seq id"):
        model.forward_cached(cache, [0], ids[:0], [0])
    with pytest.raises(ValueError, match="one length >= 1 per seq id"):
        model.forward_cached(cache, [0, 1], ids, [4])
    cache.allocate(1)
    with pytest.raises(ValueError, match="repeat"):
        model.forward_cached(cache, [0, 0], ids, [2, 2])
    model.forward_cached(cache, [0], torch.zeros(14, dtype=torch.int64), [14])
    with pytest.raises(CacheLimitError, match="max_length 16"):
        model.forward_cached(cache, [1, 0], ids, [1, 3])
    assert cache.length(0) == 14 and cache.length(1) == 0
    other = KVCache(1, 4, 8, 1, 8, "cpu")
    other.allocate(0)
    with pytest.raises(ValueError, match="layers, heads, head_dim"):
        model.forward_cached(other, [0], ids[:1], [1])
    longer = KVCache(2, 4, 8, 1, 65, "cpu")  # built by hand past the rotary table
    longer.allocate(0)
    with pytest.raises(ValueError, match="exceeds the model's max_length 64"):
        model.forward_cached(longer, [0], ids[:1], [1])


def test_new_cache_fits_the_model():
    model = make_model()
    cache = model.new_cache(3, 16)
    assert cache.attention_shape == (2, 4, 8) and cache.k.shape == (2, 3, 4, 16, 8)
    assert cache.k.dtype == torch.float32
    assert model.new_cache(1, 4, dtype=torch.float64).k.dtype == torch.float64
    with pytest.raises(ValueError, match="exceeds the model's max_length 64"):
        model.new_cache(1, 65)


def test_forward_checks_shape_and_length():
    model = make_model()
    assert model(torch.zeros(2, 5, dtype=torch.int64)).shape == (2, 5, 257)
    with pytest.raises(ValueError, match="shape"):
        model(torch.zeros(5, dtype=torch.int64))
    with pytest.raises(ValueError, match="max_length is 64"):
        model(torch.zeros(1, 65, dtype=torch.int64))


def test_config_round_trip_and_validation():
    assert TransformerConfig.from_dict(CONFIG.to_dict()) == CONFIG
    assert CONFIG.head_dim == 8
    with pytest.raises(ValueError, match="unknown TransformerConfig keys"):
        TransformerConfig.from_dict({**CONFIG.to_dict(), "dropout": 0.1})
    with pytest.raises(ValueError, match="bad TransformerConfig"):
        TransformerConfig.from_dict({"num_layers": 1})
    with pytest.raises(ValueError, match="JSON object"):
        TransformerConfig.from_dict([1, 2])
    with pytest.raises(ValueError, match="positive int"):
        TransformerConfig(num_layers=0, width=32, num_heads=4)
    with pytest.raises(ValueError, match="positive int"):
        TransformerConfig(num_layers=1, width=32.0, num_heads=4)
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(num_layers=1, width=30, num_heads=4)
    with pytest.raises(ValueError, match="even"):
        TransformerConfig(num_layers=1, width=12, num_heads=4)


def test_init_weights_is_seeded():
    a, b = make_model(3), make_model(3)
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(a.embed.weight, make_model(4).embed.weight)


def test_float64_cache_with_float32_model_matches_full_recompute():
    model = make_model()
    cache = model.new_cache(1, 16, "cpu", torch.float64)
    cache.allocate(0)
    ids = torch.arange(1, 9)
    with torch.no_grad():
        first = model.forward_cached(cache, [0], ids[:5], [5])
        rest = model.forward_cached(cache, torch.tensor([0]), ids[5:], [3])  # tensor ids work
        full = model(ids[None])[0]
    assert rest.dtype == torch.float32
    torch.testing.assert_close(torch.cat([first, rest]), full, atol=TOL, rtol=0)
