"""The bytes-per-token bound that lets the entry refuse an oversized prompt untokenized.

Soundness is checked where it matters: over many texts, no text of more than n * L counted
bytes (its bytes less those the tokenizer drops) encodes to n tokens or fewer, for the pipelines
the bound is given for, the shipped SmolLM2 tokenizer included; the same check catches a bound
that counts dropped bytes; and the bound is withheld where a pipeline can drop or shrink input
without limit.
"""

from __future__ import annotations

import json
import random
import shutil
import time
import unicodedata

import numpy as np
import pytest
from helpers import ROOT
from helpers.hf_dirs import tiny_tokenizer
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.serving.repository import EntryParams
from avspec.serving.stages.prompt_bound import (
    BYTE_LEVEL_CHARS,
    NORMAL_FORM_SHRINK,
    PromptBound,
    prompt_bound_of,
    prompt_bound_of_spec,
    prompt_byte_limit,
)
from avspec.serving.stages.requests import RequestError, parse_prompt_request

ALPHABET = "ab cd\n\t  é€🚀ΩKÅ\u0301한\u1100\u1161</s><s>"  # spaces, multibyte, combining, specials
# bytes SmolLM2 has no piece for: ASCII controls, never in UTF-8, 4-byte lead bytes 0xf1 / 0xf2
SMOLLM2_DROPPED = bytes([0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2])
SMOLLM2_DROPPED += bytes(range(0xF5, 0x100))
DELETED = bytes([0x00, 0x13, 0xC0, 0xC1, 0xF1, 0xF2])  # byte pieces deleted from the tiny BPE
# characters made of dropped bytes (0xf1 / 0xf2 lead 4-byte characters), and their neighbours
DROPPING = "\x00\x04\x06\x13\x14\x16\x1d\U00040000\U0007ffff\U00080000\U000abcde\U000f0000"


def texts(count: int, seed: int = 0, alphabet: str = ALPHABET) -> list[str]:
    rng = random.Random(seed)
    out = ["    " * 50, "🚀" * 40, "</s>" * 30, "a" * 300, "\x00" * 300, "\x13" * 300]
    out += ["a\x13" * 150, "\U00040000" * 60, "\x04\x06\x13\x14\x16\x1d" * 50]
    for _ in range(count):
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 120))))
    return out


def spec_of(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def violations(tok: Tokenizer, bound: PromptBound, alphabet: str = ALPHABET) -> list[str]:
    """The texts of more than n * L counted bytes that encode to n tokens: those the bound
    would refuse although they fit."""
    out = []
    for text in texts(400, alphabet=alphabet):
        n = len(tok.encode(text, add_special_tokens=False).ids)
        if bound.counted_bytes(text.encode()) > n * bound.token_bytes:
            out.append(text)
    return out


def assert_sound(tok: Tokenizer, bound: PromptBound, alphabet: str = ALPHABET) -> None:
    assert violations(tok, bound, alphabet) == []


def hf_dir(tmp_path, tok: Tokenizer):
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return HFTokenizer.from_directory(tmp_path)


def test_byte_level_bpe_bound_is_its_longest_piece_or_special(tmp_path) -> None:
    tok = tiny_tokenizer()
    spec = spec_of(tok)
    longest_piece = max(len(piece) for piece in spec["model"]["vocab"])  # characters = bytes
    bound = prompt_bound_of(hf_dir(tmp_path, tok))
    assert bound == PromptBound(max(longest_piece, len("</s>")), dropped=b"")
    assert_sound(tok, bound, ALPHABET + DROPPING)


def test_the_byte_level_table_is_the_pre_tokenizers() -> None:
    assert set(BYTE_LEVEL_CHARS) == set(range(256))
    assert set(BYTE_LEVEL_CHARS.values()) == set(pre_tokenizers.ByteLevel.alphabet())
    mapping = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    text = "".join(map(chr, range(0x300))) + "€🚀\U00040000\U00080000\U0010ffff"
    [(mapped, _)] = mapping.pre_tokenize_str(text)
    assert mapped == "".join(BYTE_LEVEL_CHARS[b] for b in text.encode())


def without_byte_pieces(tok: Tokenizer, deleted: bytes, **model: object) -> Tokenizer:
    """`tok` with the pieces of the `deleted` bytes (and merges using them) removed."""
    spec = spec_of(tok)
    chars = {BYTE_LEVEL_CHARS[b] for b in deleted}
    vocab = spec["model"]["vocab"]
    for piece in [p for p in vocab if chars & set(p)]:
        del vocab[piece]
    spec["model"]["merges"] = [m for m in spec["model"]["merges"] if not chars & set("".join(m))]
    spec["model"].update(model)
    return Tokenizer.from_str(json.dumps(spec))


def test_bytes_without_a_piece_are_dropped_and_not_counted() -> None:
    """A byte-level BPE lacking some byte pieces drops those bytes without a token; the bound
    (L as with every piece) counts the other bytes only, over texts full of dropped bytes."""
    full = prompt_bound_of_spec(spec_of(tiny_tokenizer()))
    tok = without_byte_pieces(tiny_tokenizer(), DELETED)
    assert tok.encode("a\x13\x13\x00b", add_special_tokens=False).tokens == ["a", "b"]
    bound = prompt_bound_of_spec(spec_of(tok))
    assert bound == PromptBound(full.token_bytes, DELETED)
    assert bound.counted_bytes("a\x13\x13\x00b\U00040000".encode()) == 5  # f1 80 80 80: 3
    assert_sound(tok, bound, ALPHABET + DROPPING)


def test_a_bound_counting_dropped_bytes_is_caught() -> None:
    """The soundness check is strong enough: counting every byte (the bug of not subtracting
    the dropped ones) refuses texts that fit, long runs of a dropped control character."""
    tok = without_byte_pieces(tiny_tokenizer(), DELETED)
    bound = prompt_bound_of_spec(spec_of(tok))
    broken = PromptBound(bound.token_bytes)  # counts all bytes
    caught = violations(tok, broken, ALPHABET + DROPPING)
    assert "\x13" * 300 in caught and "\x00" * 300 in caught
    assert tok.encode("\x13" * 300, add_special_tokens=False).ids == []  # 300 bytes, no token


@pytest.mark.parametrize("fuse", [True, False])
def test_unknown_tokens_of_a_byte_level_bpe(fuse: bool) -> None:
    """Fused unknown tokens swallow any run of missing bytes: those count as dropped. Unfused,
    each missing byte costs one token of one byte: nothing is dropped."""
    tok = without_byte_pieces(tiny_tokenizer(), DELETED, unk_token="</s>", fuse_unk=fuse)
    assert len(tok.encode("\x13" * 50, add_special_tokens=False).ids) == (1 if fuse else 50)
    bound = prompt_bound_of_spec(spec_of(tok))
    assert bound == PromptBound(bound.token_bytes, DELETED if fuse else b"")
    assert_sound(tok, bound, ALPHABET + DROPPING)


def into_dropped_replace(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.Replace("x", "\x13")  # counted byte -> dropped byte


def dropped_metaspace(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Metaspace(replacement="\x13"), pre_tokenizers.ByteLevel()]
    )


def normal_form(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.NFKC()


@pytest.mark.parametrize("change", [into_dropped_replace, dropped_metaspace, normal_form])
def test_steps_that_may_turn_counted_bytes_into_dropped_ones_give_no_bound(change) -> None:
    tok = without_byte_pieces(tiny_tokenizer(), DELETED)
    change(tok)
    assert prompt_bound_of_spec(spec_of(tok)) is None
    kept = without_byte_pieces(tiny_tokenizer(), DELETED)
    kept.normalizer = normalizers.Replace("x", "x\x13")  # no fewer counted bytes: kept
    assert prompt_bound_of_spec(spec_of(kept)) is not None
    if change is into_dropped_replace:  # what it would get wrong
        assert kept.encode("x" * 40, add_special_tokens=False).ids
        assert tok.encode("x" * 40, add_special_tokens=False).ids == []


SMOLLM2 = ROOT / "models/target"


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> HFTokenizer:
    if not (SMOLLM2 / "tokenizer.json").is_file():
        pytest.skip(f"{SMOLLM2 / 'tokenizer.json'} is absent (the default target checkpoint)")
    copy = tmp_path_factory.mktemp("smollm2")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (SMOLLM2 / name).is_file():
            shutil.copy(SMOLLM2 / name, copy / name)
    return HFTokenizer.from_directory(copy)


SMOLLM2_ALPHABET = (
    ALPHABET + DROPPING + "0123456789 ---    \r\n<|im_start|><|im_end|>éàの\U0001f600"
)


def test_the_smollm2_tokenizer_has_a_sound_bound(smollm2: HFTokenizer) -> None:
    bound = prompt_bound_of(smollm2)
    assert bound is not None and bound.dropped == SMOLLM2_DROPPED
    tok = Tokenizer.from_file(str(smollm2.directory / "tokenizer.json"))
    assert tok.encode("a\x13\x13b", add_special_tokens=False).tokens == ["a", "b"]
    assert_sound(tok, bound, SMOLLM2_ALPHABET)
    broken = violations(tok, PromptBound(bound.token_bytes), SMOLLM2_ALPHABET)
    assert "\x13" * 300 in broken  # counting the dropped bytes would be caught


def test_a_megabyte_prompt_is_refused_quickly(smollm2: HFTokenizer) -> None:
    bound = prompt_bound_of(smollm2)
    params = EntryParams(max_context=8192, max_draft_tokens=8)
    room = 8192 - 16 - 8
    prompt = ("The quick brown fox jumps over the lazy dog. " * 25_000)[:1_000_000].encode()
    values = {"text_input": np.array([prompt], dtype=object), "max_tokens": np.array([16])}
    started = time.perf_counter()
    with pytest.raises(
        RequestError,
        match=rf"^text_input is 1000000 bytes; at most {room * bound.token_bytes} counted bytes",
    ):
        parse_prompt_request(values, params, "A", bound)
    assert time.perf_counter() - started < 0.05  # a count, not a tokenization
    started = time.perf_counter()
    for _ in range(10):
        bound.counted_bytes(prompt)
    assert (time.perf_counter() - started) / 10 < 0.01  # C speed: well under a millisecond here
    controls = b"\x13" * 1_000_000 + b"hi"  # drops to 2 counted bytes: fits, as it should
    values["text_input"] = np.array([controls], dtype=object)
    assert parse_prompt_request(values, params, "A", bound).text.endswith("hi")
    values["text_input"] = np.array([controls + prompt], dtype=object)
    with pytest.raises(
        RequestError, match=r"2000002 bytes \(1000002 counted: the tokenizer drops "
    ):
        parse_prompt_request(values, params, "A", bound)


def sentencepiece_style(byte_fallback: bool, unk: str | None = None, fuse: bool = False):
    """A Llama-2 / Mistral style BPE: "▁" for spaces, few pieces, optional byte fallback."""
    vocab = {"<unk>": 0, "▁": 1, "a": 2, "b": 3, "▁a": 4, "ab": 5, "▁ab": 6}
    vocab |= {f"<0x{i:02X}>": 7 + i for i in range(256)}
    merges = [("a", "b"), ("▁", "a"), ("▁", "ab")]
    model = models.BPE(vocab, merges, unk_token=unk, fuse_unk=fuse, byte_fallback=byte_fallback)
    tok = Tokenizer(model)
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    return tok


def test_metaspace_bpe_with_byte_fallback_is_bounded_by_piece_bytes() -> None:
    tok = sentencepiece_style(byte_fallback=True)
    bound = prompt_bound_of_spec(spec_of(tok))
    assert bound == PromptBound(len("<0x00>"))  # the longest spelling; "▁ab" is 5 bytes
    assert_sound(tok, bound)


def test_an_unfused_unknown_token_counts_as_one_character() -> None:
    tok = sentencepiece_style(byte_fallback=False, unk="<unk>")
    bound = prompt_bound_of_spec(spec_of(tok))
    assert bound == PromptBound(6)
    assert_sound(tok, bound)


def test_normal_forms_multiply_the_bound() -> None:
    tok = tiny_tokenizer()
    plain = prompt_bound_of_spec(spec_of(tok)).token_bytes
    tok.normalizer = normalizers.NFKC()
    assert prompt_bound_of_spec(spec_of(tok)) == PromptBound(NORMAL_FORM_SHRINK * plain)
    assert_sound(tok, PromptBound(NORMAL_FORM_SHRINK * plain))
    assert tok.normalizer.normalize_str("𝐀" * 100) == "A" * 100  # 400 bytes -> 100


def test_no_character_shrinks_more_than_the_normal_form_factor() -> None:
    """Every code point under NFKC (the strongest form) and lowercasing keeps at least one
    byte in NORMAL_FORM_SHRINK; compositions (Hangul L + V + T, 9 bytes -> 3) shrink less."""
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        char = chr(cp)
        for out in (unicodedata.normalize("NFKC", char), char.lower()):
            assert NORMAL_FORM_SHRINK * len(out.encode()) >= len(char.encode()), hex(cp)
    jamo = "\u1100\u1161\u11a8"
    assert 3 * len(unicodedata.normalize("NFC", jamo).encode()) == len(jamo.encode())


def strip_normalizer(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.Strip()


def bert_normalizer(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.BertNormalizer()


def shorter_replace(tok: Tokenizer) -> None:
    tok.normalizer = normalizers.Replace("  ", " ")


def whitespace_split(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()


def removing_split(tok: Tokenizer) -> None:
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(" ", "removed"), pre_tokenizers.ByteLevel()]
    )


def stripping_added_token(tok: Tokenizer) -> None:
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True)])


@pytest.mark.parametrize(
    "change",
    [strip_normalizer, bert_normalizer, shorter_replace, whitespace_split, removing_split,
     stripping_added_token],
)  # fmt: skip
def test_pipelines_that_can_drop_input_have_no_bound(change) -> None:
    tok = tiny_tokenizer()
    assert prompt_bound_of_spec(spec_of(tok)) is not None
    change(tok)
    assert prompt_bound_of_spec(spec_of(tok)) is None


def test_models_that_drop_or_fuse_what_they_cannot_spell_have_no_bound() -> None:
    """Without a byte-level pre-tokenizer a dropped or fused character has no byte to count."""
    assert prompt_bound_of_spec(spec_of(sentencepiece_style(False))) is None  # dropped
    assert prompt_bound_of_spec(spec_of(sentencepiece_style(False, "<unk>", fuse=True))) is None
    spec = spec_of(tiny_tokenizer())
    full = prompt_bound_of_spec(spec)
    del spec["model"]["vocab"]["Ā"]  # byte 0x00 can no longer be spelled: BPE drops it
    assert prompt_bound_of_spec(spec) == PromptBound(full.token_bytes, b"\x00")  # uncounted
    spec["model"]["type"] = "WordPiece"
    assert prompt_bound_of_spec(spec) is None


def test_tokenizers_without_a_file_have_no_bound() -> None:
    assert prompt_bound_of(ByteTokenizer()) is None


def test_prompt_byte_limit() -> None:
    assert prompt_byte_limit(64, 440) == 28_160
    assert prompt_byte_limit(64, -3) == 0
    assert PromptBound(64, b"\x13").byte_limit(440) == 28_160
    assert PromptBound(64).counted_bytes(b"\x13\x13a") == 3
    assert PromptBound(64, b"\x13\xff").counted_bytes(b"\x13\x13a\xff") == 1


def test_byte_fallback_needs_every_byte_piece() -> None:
    spec = spec_of(sentencepiece_style(byte_fallback=True))
    assert prompt_bound_of_spec(spec) is not None
    del spec["model"]["vocab"]["<0x13>"]  # that byte can no longer fall back: it is dropped
    assert prompt_bound_of_spec(spec) is None
