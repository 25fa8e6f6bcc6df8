"""The bytes-per-token bound that lets the entry refuse an oversized prompt untokenized.

Soundness is checked where it matters: over many texts, no text of more than n * L bytes
encodes to n tokens or fewer, for the pipelines the bound is given for; and the bound is
withheld where a pipeline can drop or shrink input without limit.
"""

from __future__ import annotations

import json
import random
import unicodedata

import pytest
from helpers.hf_dirs import tiny_tokenizer
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.serving.prompt_bound import (
    NORMAL_FORM_SHRINK,
    max_token_bytes,
    prompt_byte_limit,
    token_bytes_of_spec,
)

ALPHABET = "ab cd\n\t  é€🚀ΩKÅ\u0301한\u1100\u1161</s><s>"  # spaces, multibyte, combining, specials


def texts(count: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = ["    " * 50, "🚀" * 40, "</s>" * 30, "a" * 300]
    for _ in range(count):
        out.append("".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 120))))
    return out


def spec_of(tok: Tokenizer) -> dict:
    return json.loads(tok.to_str())


def assert_sound(tok: Tokenizer, bound: int) -> None:
    for text in texts(400):
        n = len(tok.encode(text, add_special_tokens=False).ids)
        assert len(text.encode()) <= n * bound, (text, n, bound)


def hf_dir(tmp_path, tok: Tokenizer):
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return HFTokenizer.from_directory(tmp_path)


def test_byte_level_bpe_bound_is_its_longest_piece_or_special(tmp_path) -> None:
    tok = tiny_tokenizer()
    spec = spec_of(tok)
    longest_piece = max(len(piece) for piece in spec["model"]["vocab"])  # characters = bytes
    bound = max_token_bytes(hf_dir(tmp_path, tok))
    assert bound == max(longest_piece, len("</s>"))
    assert_sound(tok, bound)


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
    bound = token_bytes_of_spec(spec_of(tok))
    assert bound == len("<0x00>")  # the longest spelling; "▁ab" is 5 bytes
    assert_sound(tok, bound)


def test_an_unfused_unknown_token_counts_as_one_character() -> None:
    tok = sentencepiece_style(byte_fallback=False, unk="<unk>")
    bound = token_bytes_of_spec(spec_of(tok))
    assert bound == 6
    assert_sound(tok, bound)


def test_normal_forms_multiply_the_bound() -> None:
    tok = tiny_tokenizer()
    plain = token_bytes_of_spec(spec_of(tok))
    tok.normalizer = normalizers.NFKC()
    assert token_bytes_of_spec(spec_of(tok)) == NORMAL_FORM_SHRINK * plain
    assert_sound(tok, NORMAL_FORM_SHRINK * plain)
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
    assert token_bytes_of_spec(spec_of(tok)) is not None
    change(tok)
    assert token_bytes_of_spec(spec_of(tok)) is None


def test_models_that_drop_or_fuse_what_they_cannot_spell_have_no_bound() -> None:
    assert token_bytes_of_spec(spec_of(sentencepiece_style(False))) is None  # dropped
    assert token_bytes_of_spec(spec_of(sentencepiece_style(False, "<unk>", fuse=True))) is None
    partial = tiny_tokenizer()
    spec = spec_of(partial)
    del spec["model"]["vocab"]["Ā"]  # byte 0x00 can no longer be spelled: BPE drops it
    assert token_bytes_of_spec(spec) is None
    spec["model"]["type"] = "WordPiece"
    assert token_bytes_of_spec(spec) is None


def test_tokenizers_without_a_file_have_no_bound() -> None:
    assert max_token_bytes(ByteTokenizer()) is None


def test_prompt_byte_limit() -> None:
    assert prompt_byte_limit(64, 440) == 28_160
    assert prompt_byte_limit(64, -3) == 0
