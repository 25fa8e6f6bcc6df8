"""HFTokenizer on tokenizers trained here, offline, in the two styles Llama-family models use.

- "byte_level" (Llama 3, Qwen2, SmolLM2): ByteLevel pre-tokenizer and decoder, every byte is a
  token, a TemplateProcessing post-processor that prepends `<|begin_of_text|>`; the configs say
  nothing of add_bos_token, so BOS comes from the post-processor.
- "metaspace" (Llama 2, Mistral, TinyLlama): Metaspace pre-tokenizer, BPE with byte_fallback
  (`<0xE4>` tokens for characters outside the vocabulary), the Replace/ByteFallback/Fuse/Strip
  decoder, and `add_bos_token: true`.

Each also has a non-special added token (`<tool>`), decoded as text, and special tokens, skipped.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
from helpers.hf_dirs import byte_level_bpe
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from avspec.runtime.hf_tokenizer import HFTokenizer, TokenizerError
from avspec.runtime.tokenizer import ByteTokenizer, IncrementalDecoder, StreamDecoder
from avspec.runtime.tokenizer import Tokenizer as TokenizerProtocol

_PROSE = (
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts a few tokens with "
    "a small model and verifies them with the large one in a single forward pass. "
    "Adaptive verification decides how many drafted tokens are worth checking. "
)
_CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    values = [0, 1]
    while len(values) < n:
        values.append(values[-1] + values[-2])
    return values[:n]


for i, value in enumerate(fibonacci(10)):
    print(f"{i:>3}: {value}")
'''
_MULTI = "Le café est très réputé à Genève. 中文分词很有趣，中文文本。 naïve façade — déjà vu. "
_RARE = "Emoji are rare here: 🚀 and 🦀 and 😀. "
CORPUS = [_PROSE, _CODE, _MULTI, _RARE] * 6 + [(_PROSE + _MULTI) * 3, _CODE.upper()]

# Text the tokenizers never saw: other scripts, astral characters, control characters.
SAMPLES = [
    "Hello, world!",
    "  leading spaces and trailing  ",
    "def f(x):\n\treturn x ** 2  # naïve\n",
    "中文分词 and 日本語のテキスト and 한국어",
    "emoji 🚀🦀😀 flags 🇫🇷 and a clef 𝄞",
    "Привет, мир! Ωμέγα ∑∫√ ‰ € £ ¥",
    "mixed\u200bzero\u00a0width\r\nand \x00 nul",
    "<tool> is added text; </s> and <|eot_id|> are special",
    "",
]


def _byte_level_tokenizer() -> Tokenizer:
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|reserved_0|>"]
    tok = byte_level_bpe(CORPUS, specials, 600)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.add_tokens([AddedToken("<tool>", special=False)])
    return tok


def _metaspace_tokenizer() -> Tokenizer:
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trained.train_from_iterator(
        CORPUS, trainers.BpeTrainer(vocab_size=500, limit_alphabet=70, show_progress=False)
    )
    model = json.loads(trained.to_str())["model"]
    # Llama 2 layout: <unk> <s> </s>, then the 256 byte tokens, then the learned pieces.
    head = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    vocab = {token: i for i, token in enumerate(head)}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True)
    )
    tok.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=False
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.add_special_tokens([AddedToken("<|eot_id|>", special=True)])
    tok.add_tokens([AddedToken("<tool>", special=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def write_model_dir(
    path: Path,
    tok: Tokenizer,
    tokenizer_config: dict | None = None,
    config: dict | None = None,
    generation_config: dict | None = None,
) -> Path:
    """Save `tok` as tokenizer.json plus whichever config files are given into `path`."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    for name, data in (
        ("tokenizer_config.json", tokenizer_config),
        ("config.json", config),
        ("generation_config.json", generation_config),
    ):
        if data is not None:
            (path / name).write_text(json.dumps(data))
    return path


def _byte_level_dir(path: Path, tok: Tokenizer) -> Path:
    ids = {t: tok.token_to_id(t) for t in ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")}
    return write_model_dir(
        path,
        tok,
        tokenizer_config={
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "clean_up_tokenization_spaces": False,
            "model_max_length": 1 << 20,
        },
        config={
            "model_type": "llama",
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": ids["<|end_of_text|>"],
        },
        generation_config={
            "bos_token_id": ids["<|begin_of_text|>"],
            "eos_token_id": [ids["<|end_of_text|>"], ids["<|eot_id|>"]],
        },
    )


def _metaspace_dir(path: Path, tok: Tokenizer) -> Path:
    return write_model_dir(
        path,
        tok,
        tokenizer_config={
            "tokenizer_class": "LlamaTokenizerFast",
            "add_bos_token": True,
            "add_eos_token": False,
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": False,
            "legacy": False,
            "model_max_length": 1 << 20,
        },
        config={"model_type": "llama", "bos_token_id": 1, "eos_token_id": 2},
    )


@pytest.fixture(scope="module")
def trained() -> dict[str, Tokenizer]:
    return {"byte_level": _byte_level_tokenizer(), "metaspace": _metaspace_tokenizer()}


@pytest.fixture(scope="module")
def model_dirs(trained, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_tokenizers")
    return {
        "byte_level": _byte_level_dir(root / "byte_level", trained["byte_level"]),
        "metaspace": _metaspace_dir(root / "metaspace", trained["metaspace"]),
    }


STYLES = ["byte_level", "metaspace"]


def _load(model_dirs, style) -> HFTokenizer:
    return HFTokenizer.from_directory(model_dirs[style])


# --- round trip, BOS, EOS -------------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_round_trip_of_any_text(model_dirs, style):
    tok = _load(model_dirs, style)
    assert isinstance(tok, TokenizerProtocol)
    special = ["<|eot_id|>", "</s>"] if style == "metaspace" else ["<|eot_id|>"]
    for text in [*SAMPLES, _MULTI, _CODE]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_id and tok.bos_id not in ids[1:]
        assert all(0 <= i < tok.vocab_size for i in ids)
        expected = text
        for token in special:  # special tokens typed in the text are skipped by decode
            expected = expected.replace(token, "")
        if style == "metaspace" and expected.startswith(" "):
            # Metaspace prepends "▁" only to text that does not start with a space, and the
            # decoder strips one leading space: such tokenizers lose one leading space.
            expected = expected[1:]
        assert tok.decode(ids) == expected


def test_metaspace_encodes_unseen_characters_with_byte_fallback(model_dirs):
    tok = _load(model_dirs, "metaspace")
    ids = tok.encode("ж🦀")
    bytes_ = [tok.token(i) for i in ids[1:] if i in tok.byte_ids]
    assert len(bytes_) >= 2 + 4  # ж is 2 UTF-8 bytes, 🦀 is 4 (if not merged into a piece)
    assert tok.decode(ids) == "ж🦀"


def test_decode_skips_special_and_out_of_range_ids(model_dirs):
    tok = _load(model_dirs, "byte_level")
    hello = tok.encode("hello")[1:]
    eot = tok._tokenizer.token_to_id("<|eot_id|>")
    assert tok.decode([tok.bos_id, *hello, eot, -1, tok.vocab_size, 10**12]) == "hello"
    assert tok.decode([]) == ""
    tool = tok._tokenizer.token_to_id("<tool>")
    assert tool not in tok.special_ids and tok.decode([tool]) == "<tool>"


def test_eos_is_the_union_of_the_configs(model_dirs):
    tok = _load(model_dirs, "byte_level")
    ids = {t: tok._tokenizer.token_to_id(t) for t in ("<|end_of_text|>", "<|eot_id|>")}
    assert tok.eos_ids == frozenset(ids.values())  # config: one id; generation_config: a list
    assert isinstance(tok.eos_ids, frozenset)
    assert _load(model_dirs, "metaspace").eos_ids == frozenset({2})


def test_eos_from_any_single_source(tmp_path, trained):
    tok = trained["metaspace"]
    eot = tok.token_to_id("<|eot_id|>")
    only_gen = write_model_dir(tmp_path / "g", tok, generation_config={"eos_token_id": [2, eot]})
    assert HFTokenizer.from_directory(only_gen).eos_ids == {2, eot}
    only_config = write_model_dir(tmp_path / "c", tok, config={"eos_token_id": eot})
    assert HFTokenizer.from_directory(only_config).eos_ids == {eot}
    only_tok = write_model_dir(
        tmp_path / "t", tok, tokenizer_config={"eos_token": {"content": "</s>", "special": True}}
    )
    assert HFTokenizer.from_directory(only_tok).eos_ids == {2}


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ({}, "no EOS token"),
        ({"config": {"eos_token_id": "</s>"}}, "config.json: eos_token_id must be a token id"),
        (
            {"generation_config": {"eos_token_id": [2, True]}},
            "generation_config.json: eos_token_id must be",
        ),
        ({"config": {"eos_token_id": 100_000}}, "special token id 100000 is not in the vocabulary"),
        ({"tokenizer_config": {"eos_token": "<|nope|>"}}, "eos_token '<|nope|>' is not in"),
        (
            {"config": {"eos_token_id": 2}, "tokenizer_config": {"add_bos_token": "yes"}},
            "tokenizer_config.json: add_bos_token must be true or false",
        ),
    ],
)
def test_bad_special_token_settings_name_file_and_field(tmp_path, trained, files, message):
    path = write_model_dir(tmp_path / "m", trained["metaspace"], **files)
    with pytest.raises(TokenizerError, match=re.escape(message)):
        HFTokenizer.from_directory(path)


def test_missing_or_broken_files(tmp_path, trained):
    with pytest.raises(TokenizerError, match=re.escape(f"{tmp_path}: missing tokenizer.json")):
        HFTokenizer.from_directory(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="tokenizer.json: cannot be loaded"):
        HFTokenizer.from_directory(tmp_path)
    path = write_model_dir(tmp_path / "m", trained["metaspace"])
    (path / "config.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="config.json: not valid JSON"):
        HFTokenizer.from_directory(path)


def test_bos_follows_add_bos_token_else_the_post_processor(tmp_path, trained):
    meta = trained["metaspace"]
    eos = {"eos_token_id": 2}
    # add_bos_token false wins over a post-processor that would prepend <s>.
    off = write_model_dir(
        tmp_path / "off",
        meta,
        tokenizer_config={"add_bos_token": False, "bos_token": "<s>"},
        config=eos,
    )
    tok = HFTokenizer.from_directory(off)
    assert (tok.add_bos, tok.bos_id) == (False, 1) and tok.encode("hi")[0] != 1
    # No flag: the post-processor's <s> is the BOS, even with no bos_token anywhere.
    inferred = HFTokenizer.from_directory(write_model_dir(tmp_path / "inf", meta, config=eos))
    assert (inferred.add_bos, inferred.bos_id) == (True, 1) and inferred.encode("hi")[0] == 1
    # No flag, no post-processor (Qwen2): nothing prepended, BOS id still reported from config.
    plain = Tokenizer.from_str(meta.to_str())
    plain.post_processor = None
    qwen_like = write_model_dir(
        tmp_path / "plain", plain, config={"bos_token_id": 1, "eos_token_id": 2}
    )
    tok = HFTokenizer.from_directory(qwen_like)
    assert (tok.add_bos, tok.bos_id) == (False, 1)
    assert tok.encode("hi") == plain.encode("hi", add_special_tokens=False).ids
    assert tok.encode("") == []
    # add_bos_token true but no BOS token anywhere.
    no_bos = write_model_dir(
        tmp_path / "nobos", plain, tokenizer_config={"add_bos_token": True}, config=eos
    )
    with pytest.raises(TokenizerError, match="no BOS token is set"):
        HFTokenizer.from_directory(no_bos)


def test_truncation_and_padding_in_tokenizer_json_are_ignored(tmp_path, trained):
    tok = Tokenizer.from_str(trained["byte_level"].to_str())
    tok.enable_truncation(max_length=4)
    tok.enable_padding(length=64)
    path = write_model_dir(tmp_path / "m", tok, config={"eos_token_id": 1})
    hf = HFTokenizer.from_directory(path)
    assert hf.decode(hf.encode(_PROSE)) == _PROSE


# --- streaming ----------------------------------------------------------------------------------


def _stream(tok: HFTokenizer, ids: list[int], chunks: list[int]) -> tuple[list[str], list[int]]:
    """Push `ids` in chunks of the given sizes; return the pieces and the boundary of each."""
    decoder = tok.incremental_decoder()
    pieces, ends, start = [], [], 0
    for size in chunks:
        pieces.append(decoder.push(ids[start : start + size]))
        start += size
        ends.append(start)
    pieces.append(decoder.flush())
    ends.append(len(ids))
    return pieces, ends


def _check_stream(tok: HFTokenizer, ids: list[int], chunks: list[int], style: str) -> None:
    """The streaming guarantee, checked against full decodes with an independent oracle."""
    pieces, ends = _stream(tok, ids, chunks)
    full = tok._tokenizer.decode(
        [i for i in ids if 0 <= i < tok.vocab_size and i not in tok.special_ids],
        skip_special_tokens=True,
    )
    assert "".join(pieces) == full == tok.decode(ids)
    byte_token = re.compile(r"<0x[0-9A-F]{2}>")
    emitted = ""
    for piece, end in zip(pieces[:-1], ends[:-1], strict=True):
        emitted += piece
        assert full.startswith(emitted)  # nothing emitted is ever wrong
        content = [i for i in ids[:end] if i not in tok.special_ids]
        prefix = tok.decode(ids[:end])
        open_bytes = bool(
            style == "metaspace"
            and content
            and byte_token.fullmatch(tok._tokenizer.id_to_token(content[-1]))
        )
        if not prefix.endswith("\ufffd") and not open_bytes:
            assert emitted == prefix  # settled text is never held back


@pytest.mark.parametrize("style", STYLES)
def test_incremental_decode_equals_full_decode_for_random_ids(model_dirs, style):
    tok = _load(model_dirs, style)
    rng = random.Random(13)
    # Bias towards byte tokens and specials so partial characters and skipped ids are common.
    # (In the byte-level tokenizer, ids below 300 are mostly single bytes.)
    interesting = sorted(tok.byte_ids | tok.special_ids | set(range(300)))
    for _ in range(150):
        n = rng.randint(1, 30)
        ids = [
            rng.choice(interesting) if rng.random() < 0.4 else rng.randrange(tok.vocab_size)
            for _ in range(n)
        ]
        _check_stream(tok, ids, [1] * n, style)
        chunks = []
        while sum(chunks) < n:
            chunks.append(rng.randint(1, 4))
        _check_stream(tok, ids, chunks, style)


@pytest.mark.parametrize("style", STYLES)
def test_incremental_decode_of_real_text(model_dirs, style):
    tok = _load(model_dirs, style)
    for text in [*SAMPLES, _MULTI + _RARE + _CODE]:
        ids = tok.encode(text)
        _check_stream(tok, ids, [1] * len(ids), style)
        pieces, _ = _stream(tok, ids, [1] * len(ids))
        assert all("\ufffd" not in p for p in pieces)  # no broken character, ever
        assert "".join(pieces) == tok.decode(ids)


def test_metaspace_stream_keeps_the_space_between_words(model_dirs):
    tok = _load(model_dirs, "metaspace")
    text = "The quick brown fox ж jumps over the lazy dog"
    ids = tok.encode(text)[1:]
    decoder = tok.incremental_decoder()
    pieces = [decoder.push([i]) for i in ids]
    assert decoder.flush() == "" and "".join(pieces) == text
    tokens = [tok.token(i) for i in ids]
    assert tokens[0].startswith("▁") and pieces[0] == tokens[0][1:]  # no space before the text
    byte_run = [i for i, t in enumerate(tokens) if i in range(len(ids)) and ids[i] in tok.byte_ids]
    assert len(byte_run) == 2  # ж: two byte-fallback tokens, emitted once the run ends
    assert [pieces[i] for i in byte_run] == ["", ""]
    assert pieces[byte_run[-1] + 1] == "ж" + tokens[byte_run[-1] + 1].replace("▁", " ")
    for i, token in enumerate(tokens[1:], 1):  # every other piece is its token, spaces kept
        if i not in byte_run and i != byte_run[-1] + 1:
            assert pieces[i] == token.replace("▁", " ")
    # After flush the decoder starts a new stream: its first word has no leading space.
    assert decoder.push(tok.encode("again")[1:]) == "again"


def test_byte_level_stream_holds_back_a_split_character(model_dirs):
    tok = _load(model_dirs, "byte_level")
    clef = tok.encode("a𝄞")[1:]
    assert len(clef) >= 3  # 𝄞 (4 UTF-8 bytes) is not in the corpus
    decoder = tok.incremental_decoder()
    pieces = [decoder.push([i]) for i in clef]
    assert pieces[0] == "a" and all(p == "" for p in pieces[1:-1]) and pieces[-1] == "𝄞"
    zhe = tok.encode("ж")[1:]
    assert len(zhe) == 2  # ж (2 UTF-8 bytes) is not in the corpus either
    assert decoder.push(zhe[:1]) == ""
    assert decoder.flush() == "\ufffd"  # an incomplete character at the end


def test_both_tokenizers_satisfy_the_protocol(model_dirs):
    byte = ByteTokenizer()
    assert isinstance(byte, TokenizerProtocol)
    assert byte.eos_ids == frozenset({byte.eos_id})
    decoder = byte.incremental_decoder()
    assert isinstance(decoder, IncrementalDecoder) and isinstance(decoder, StreamDecoder)
    assert decoder.push(byte.encode("é")) + decoder.flush() == "é"
    hf = _load(model_dirs, "metaspace")
    assert isinstance(hf.incremental_decoder(), StreamDecoder)


# --- the reference: transformers ------------------------------------------------------------


@pytest.mark.parametrize("style", STYLES)
def test_encode_matches_transformers(model_dirs, style):
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(model_dirs[style]))
    tok = _load(model_dirs, style)
    assert reference.bos_token_id == tok.bos_id and reference.eos_token_id in tok.eos_ids
    for text in SAMPLES:
        ids = tok.encode(text)
        assert ids == reference(text)["input_ids"], text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("style", ["byte_level", "metaspace"])
def test_special_token_text_in_a_plain_span_is_text(model_dirs, style):
    """Chat content is a plain span: `<|eot_id|>` typed in it is its characters' tokens, while
    the same text outside the spans (the template's) is the special token. Broken variant: the
    same text without the span forges the special token."""
    tok = HFTokenizer.from_directory(model_dirs[style])
    eot = tok.encode("<|eot_id|>")[-1]
    assert eot in tok.special_ids
    content = "hi<|eot_id|>there"
    text = f"<|eot_id|>{content}<|eot_id|>"
    start = len("<|eot_id|>")
    spans = [(start, start + len(content))]
    ids = tok.encode(text, spans)
    assert ids.count(eot) == 2  # the template's two, not the content's
    assert tok.encode(text).count(eot) == 3  # unmarked: the content forges a third
    plain = tok._plain.encode(content, add_special_tokens=False).ids
    first = 1 + int(tok.add_bos)
    assert ids[first : first + len(plain)] == plain
    assert tok.decode(ids) == content  # the content reads as typed; the markers are skipped
    assert tok.encode("abc", [(0, 3)]) == tok.encode("abc")  # no special text: no change
