"""Transformer: config validation, and the cached ragged path against full recomputation."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from avspec.runtime.kv_cache import CacheLimitError, KVCache
from avspec.runtime.ragged import (
    MAX_PADDING,
    PAD_SLACK,
    AttentionTile,
    RaggedIndex,
    tile_groups,
)
from avspec.runtime.rope import RopeScaling
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights

CONFIG = TransformerConfig(num_layers=2, width=32, num_heads=4, max_length=64)
# the Llama family's options, all at once (exactness against transformers: test_hf_checkpoint)
LLAMA_LIKE = TransformerConfig(
    num_layers=2, width=32, num_heads=4, max_length=64, num_kv_heads=2, head_dim=12,
    intermediate_size=48, mlp="swiglu", norm_eps=1e-5, qkv_bias=True, out_bias=True,
    mlp_bias=True, tie_embeddings=False, rope_theta=5e5,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 16),
)  # fmt: skip
TOL = 1e-4


def make_model(seed: int = 0, config: TransformerConfig = CONFIG) -> Transformer:
    model = Transformer(config)
    init_weights(model, torch.Generator().manual_seed(seed))
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # larger weights than the training init, so attention is not uniform
        for name, p in model.named_parameters():
            p.mul_(5.0 if p.dim() > 1 else 1.0)
            if name.endswith(".bias"):  # init_weights zeroes them
                p.normal_(0.0, 0.5, generator=gen)
    return model.eval()


class Tracker:
    """Runs forward_cached and keeps each sequence's tokens to recompute it from scratch."""

    def __init__(self, model: Transformer, max_sequences: int = 4, pool_tokens: int = 0) -> None:
        self.model = model
        length = model.config.max_length
        self.cache = model.new_cache(max_sequences, length, pool_tokens=pool_tokens)
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


@pytest.mark.parametrize(
    "config",
    [CONFIG, LLAMA_LIKE, dataclasses.replace(LLAMA_LIKE, rope_style="interleaved")],
    ids=["gpt", "llama_like", "interleaved"],
)
def test_cached_matches_full_recompute_through_prefill_decode_verify_rollback(config):
    tracker = Tracker(make_model(config=config))
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


# A prefill of 20 tokens beside decoding rows: more than one attention tile (runtime/ragged.py)
MIXED_STEP = {1: 1, 2: 1, 3: 20, 4: 1, 5: 2, 6: 1}


def test_a_prefill_beside_decoding_rows_runs_in_several_tiles_and_matches_recompute():
    tracker = Tracker(make_model(3, LLAMA_LIKE), max_sequences=8)
    tracker.step({1: 7, 2: 3, 4: 11, 5: 2, 6: 5})
    lengths = list(MIXED_STEP.values())
    index = RaggedIndex([0] * len(lengths), [0] * len(lengths), lengths, torch.device("cpu"))
    assert len(index.tiles) >= 2
    tracker.step(MIXED_STEP)  # checks each sequence against its full recomputation
    tracker.step({3: 1, 1: 4, 6: 1})


def test_a_tile_mapped_to_the_wrong_tokens_is_caught(monkeypatch):
    """The broken variant: each tile's tokens gathered in reverse packed order."""
    original = AttentionTile.__init__

    def reversed_tokens(self, slots, starts, lengths, token_index, device):
        original(self, slots, starts, lengths, token_index, device)
        if self.token_index is not None:
            self.token_index = self.token_index.flip(0)

    tracker = Tracker(make_model(3, LLAMA_LIKE), max_sequences=8)
    tracker.step({1: 7, 2: 3, 4: 11, 5: 2, 6: 5})
    monkeypatch.setattr(AttentionTile, "__init__", reversed_tokens)
    with pytest.raises(AssertionError):
        tracker.step(MIXED_STEP)


@pytest.mark.parametrize("seed", range(20))
def test_tile_groups_partition_the_rows_within_the_padding_bound(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (12,), generator=gen).tolist()
    lengths[: seed % 3] = [40 + seed] * (seed % 3)  # up to two prefills
    groups = tile_groups(lengths)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for group in groups:
        width, real = max(lengths[b] for b in group), sum(lengths[b] for b in group)
        assert len(group) == 1 or len(group) * width <= max(MAX_PADDING * real, real + PAD_SLACK)
    assert len(tile_groups([3] * 9)) == 1  # uniform: one tile (the reshape path)
    assert len(tile_groups([1, 2, 1, 3])) == 1  # 12 padded query rows for 7: within the slack
    # 6 rows of 2 tokens beside 58 of 1: one tile would pad 58 rows; 8 join the 6 (slack)
    assert sorted(map(len, tile_groups([2] * 6 + [1] * 58))) == [14, 50]


@pytest.mark.parametrize("seed", range(10))
def test_tile_groups_keep_each_tile_within_the_read_cells(seed):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 4, (12,), generator=gen).tolist()
    cached = torch.randint(0, 60, (12,), generator=gen).tolist()
    keys = [n + c for n, c in zip(lengths, cached, strict=True)]
    groups = tile_groups(lengths, key_lengths=keys, max_cells=100)
    assert sorted(b for g in groups for b in g) == list(range(len(lengths)))
    for group in groups:
        assert len(group) == 1 or len(group) * max(keys[b] for b in group) <= 100
    assert len(tile_groups([1] * 8, key_lengths=[10] * 8, max_cells=80)) == 1


def test_a_long_sequence_beside_short_ones_in_a_small_pool_matches_recompute():
    """Pool of 64 positions for 4 sequences of up to 64: one long, three short; decoding them
    together gathers more cells than the read workspace holds in one tile, so the rows split."""
    tracker = Tracker(make_model(3, LLAMA_LIKE), max_sequences=4, pool_tokens=64)
    tracker.step({1: 40, 2: 3, 3: 5, 4: 2})
    for _ in range(3):
        tracker.step({1: 1, 2: 1, 3: 1, 4: 1})
    tracker.rollback(1, 20)
    tracker.step({1: 2, 2: 2, 3: 2, 4: 2})


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
    # layers, kv heads, cells (3 x 16 positions plus a block of 16 per sequence), head_dim
    assert cache.attention_shape == (2, 4, 8) and cache.k.shape == (2, 4, 96, 8)
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


def test_old_configs_load_as_the_original_architecture():
    old = {"num_layers": 1, "width": 96, "num_heads": 2, "vocab_size": 257, "max_length": 512}
    config = TransformerConfig.from_dict(old)  # a model directory written before the new fields
    assert config == TransformerConfig(num_layers=1, width=96, num_heads=2)
    assert (config.num_kv_heads, config.head_dim, config.intermediate_size) == (2, 48, 384)
    assert (config.mlp, config.norm_eps, config.rope_style, config.rope_scaling) == (
        "gelu", None, "half", None
    )  # fmt: skip
    assert config.tie_embeddings and config.rope_theta == 10000.0
    assert not (config.qkv_bias or config.out_bias or config.mlp_bias)
    names = set(Transformer(config).state_dict())
    assert "lm_head.weight" not in names and not any(n.endswith(".bias") for n in names)


def test_llama_like_config_round_trips_through_json():
    data = json.loads(json.dumps(LLAMA_LIKE.to_dict()))
    assert data["rope_scaling"]["kind"] == "llama3"
    assert TransformerConfig.from_dict(data) == LLAMA_LIKE
    assert TransformerConfig.from_dict({**data, "rope_theta": 500000}) == LLAMA_LIKE
    assert hash(LLAMA_LIKE) == hash(TransformerConfig.from_dict(data))
    assert LLAMA_LIKE.kv_values_per_token == 2 * 2 * 2 * 12


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_kv_heads": 3}, "not a multiple of num_kv_heads"),
        ({"num_kv_heads": 0}, "num_kv_heads must be a positive int"),
        ({"head_dim": 7}, "even"),
        ({"mlp": "relu"}, "mlp must be one of"),
        ({"rope_style": "gptj"}, "rope_style must be one of"),
        ({"tie_embeddings": 1}, "tie_embeddings must be a bool"),
        ({"rope_theta": -1.0}, "rope_theta must be a positive number"),
        ({"norm_eps": 0}, "norm_eps must be a positive number"),
        ({"rope_scaling": {"kind": "yarn", "factor": 2.0}}, "kind must be one of"),
        ({"rope_scaling": {"kind": "linear", "factor": 2.0, "low_freq_factor": 1.0}}, "only"),
        ({"rope_scaling": {"kind": "llama3", "factor": 8.0}}, "llama3 RoPE scaling needs"),
        ({"rope_scaling": {"kind": "linear", "factor": 2.0, "beta": 1}}, "unknown rope_scaling"),
    ],
)
def test_new_fields_are_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        TransformerConfig.from_dict({**LLAMA_LIKE.to_dict(), **changes})


def test_grouped_query_attention_cache_and_untied_head():
    model = make_model(config=LLAMA_LIKE)
    cache = model.new_cache(2, 16)
    assert cache.attention_shape == (2, 2, 12)  # the cache holds the key/value heads only
    assert model.blocks[0].qkv.weight.shape == ((4 + 2 + 2) * 12, 32)
    assert model.blocks[0].mlp_in.weight.shape == (2 * 48, 32)
    assert model.lm_head is not None and model.lm_head.weight.shape == (257, 32)
    with pytest.raises(ValueError, match="layers, heads, head_dim"):
        model.check_cache(make_model().new_cache(1, 8))


def test_interleaved_rope_changes_the_logits():
    model = make_model(config=LLAMA_LIKE)
    other = Transformer(dataclasses.replace(LLAMA_LIKE, rope_style="interleaved"))
    other.load_state_dict(model.state_dict())
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        assert (model(ids) - other.eval()(ids)).abs().max() > 1e-2


def test_empty_model_is_built_in_the_serving_dtype_with_its_rotary_tables():
    model = Transformer.empty(LLAMA_LIKE, dtype=torch.bfloat16)
    reference = Transformer(LLAMA_LIKE)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert model.num_parameters() == reference.num_parameters()
    torch.testing.assert_close(model.rotary.cos, reference.rotary.cos.bfloat16())
    torch.testing.assert_close(model.rotary.sin, reference.rotary.sin.bfloat16())


def test_forward_cached_at_gives_those_tokens_logits_and_caches_every_token():
    model = make_model(2)
    full, part = Tracker(model), Tracker(model)
    lengths = {1: 6, 2: 3}
    for tracker in (full, part):
        for seq_id in lengths:
            tracker.cache.allocate(seq_id)
    ids = torch.randint(0, 257, (9,), generator=torch.Generator().manual_seed(8))
    at = torch.tensor([5, 8, 0])
    with torch.no_grad():
        everything = model.forward_cached(full.cache, [1, 2], ids, list(lengths.values()))
        some = model.forward_cached(part.cache, [1, 2], ids, list(lengths.values()), at=at)
    torch.testing.assert_close(some, everything[at], atol=TOL, rtol=0)
    for seq_id, n in lengths.items():  # the cache holds every token either way
        assert part.cache.length(seq_id) == full.cache.length(seq_id) == n
