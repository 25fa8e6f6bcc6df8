"""Byte tokenizer round trip, EOS handling, and incremental UTF-8 decoding."""

from __future__ import annotations

from avspec.runtime.tokenizer import ByteTokenizer, IncrementalDecoder

TEXT = "def f(x):\n    return 'héllo wörld €𝄞'  # naïve"


def test_round_trip_and_constants():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_id == 256
    ids = tok.encode(TEXT)
    assert ids == list(TEXT.encode("utf-8"))
    assert all(0 <= i <= 255 for i in ids)
    assert tok.decode(ids) == TEXT


def test_decode_skips_eos_and_never_raises():
    tok = ByteTokenizer()
    assert tok.decode([104, 256, 105, 256]) == "hi"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"  # truncated euro sign
    assert tok.decode([104, 999, -1]) == "h\ufffd\ufffd"  # out-of-range ids
    assert tok.decode([]) == ""


def test_incremental_decoder_holds_back_partial_characters():
    ids = ByteTokenizer().encode(TEXT)
    for split in range(1, 5):  # every chunking of the stream gives the same text
        decoder = IncrementalDecoder()
        pieces = [decoder.push(ids[i : i + split]) for i in range(0, len(ids), split)]
        assert "\ufffd" not in "".join(pieces)
        assert "".join(pieces) + decoder.flush() == TEXT


def test_incremental_decoder_multibyte_split_across_pushes():
    decoder = IncrementalDecoder()
    clef = list("𝄞".encode())  # 4 bytes
    assert decoder.push([97, clef[0]]) == "a"
    assert decoder.push(clef[1:3]) == ""
    assert decoder.push([clef[3], 256]) == "𝄞"  # EOS is skipped
    assert decoder.flush() == ""


def test_incremental_decoder_flush_replaces_incomplete_tail():
    decoder = IncrementalDecoder(ByteTokenizer())
    assert decoder.push([0xE2, 0x82]) == ""
    assert decoder.flush() == "\ufffd"
    assert decoder.push([0xFF]) == "\ufffd"  # invalid byte: replaced immediately
    assert decoder.push([300]) == "\ufffd"  # out-of-range id
