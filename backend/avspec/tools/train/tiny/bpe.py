"""A byte-level BPE tokenizer for the default pair, trained with `tokenizers` on the train split.

The tokenizer is the Llama 3 / Qwen2 / GPT-2 kind: text is UTF-8 encoded and every byte mapped
to one of 256 printable characters (`pre_tokenizers.ByteLevel`) before BPE merges, and the
256 byte characters are the initial alphabet. So every text (every Unicode string, hence every
byte sequence once decoded as UTF-8) encodes with no unknown token, and decoding the ids gives
the text back exactly. The pre-tokenizer splits on GPT-2's word/number/space pattern; there
is no normalizer.

Special tokens: `EOS_TOKEN` is id 0 (`EOS_ID`). It ends every training file (files are joined
with it, as `avspec.tools.train.tiny.corpus` does for bytes) and it stands as BOS too (GPT-2
practice): the model config names it as both `bos_token_id` and `eos_token_id`, and `encode`
prepends nothing (`add_bos_token` false), so a prompt is text continued as-is.

`save_tokenizer` writes `tokenizer.json`, `tokenizer_config.json` and `special_tokens_map.json`
(what `transformers.AutoTokenizer` and `avspec.runtime.hf_tokenizer.HFTokenizer` read); the ids
the model config needs are `special_ids(tokenizer)`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from avspec.runtime.hf_files import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE
from avspec.runtime.json_file import write_json

EOS_TOKEN = "<|endoftext|>"
EOS_ID = 0  # the first special token: stable for every vocabulary size and corpus
DEFAULT_VOCAB_SIZE = 4096


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` pieces (EOS and 256 bytes included).

    Raises ValueError when `texts` are too small to learn that many merges.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size {vocab_size} is below the 256 bytes plus EOS")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_ID:  # the trainer places specials first
        raise RuntimeError(f"{EOS_TOKEN} got id {tokenizer.token_to_id(EOS_TOKEN)}, not {EOS_ID}")
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the text allows only {tokenizer.get_vocab_size()} pieces, not {vocab_size}"
        )
    return tokenizer


def train_split_tokenizer(
    files: Sequence[tuple[str, str]], vocab_size: int = DEFAULT_VOCAB_SIZE
) -> Tokenizer:
    """`train_bpe` on the texts of (name, text) files: the train split of `corpus.split_files`."""
    return train_bpe((text for _, text in files), vocab_size)


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    """The ids a model config needs: `bos_token_id`, `eos_token_id` (both EOS) and
    `vocab_size`."""
    eos = tokenizer.token_to_id(EOS_TOKEN)
    if eos is None:
        raise ValueError(f"the tokenizer has no {EOS_TOKEN} token")
    return {"bos_token_id": eos, "eos_token_id": eos, "vocab_size": tokenizer.get_vocab_size()}


def save_tokenizer(tokenizer: Tokenizer, directory: Path | str, max_length: int) -> Path:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into `directory`
    (created if needed); `max_length` is the models' context. Returns the directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / TOKENIZER_FILE))
    specials = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    write_json(directory / TOKENIZER_CONFIG_FILE, config)
    write_json(directory / SPECIAL_TOKENS_MAP_FILE, specials)
    return directory


def encode_texts(tokenizer: Tokenizer, files: Sequence[tuple[str, str]]) -> torch.Tensor:
    """Join (name, text) files with EOS into one token stream [tokens] int64 (the BPE analogue
    of `corpus.encode_files`)."""
    eos = special_ids(tokenizer)["eos_token_id"]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([text for _, text in files], add_special_tokens=False):
        ids += encoding.ids
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.int64)
