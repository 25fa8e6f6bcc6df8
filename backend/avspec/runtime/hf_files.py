"""The file names of a Hugging Face model directory, in one place for every reader and writer."""

from __future__ import annotations

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"  # the weight map of a sharded checkpoint
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# a draft stored without the embedding it shares with its target
# (avspec.tools.train.draft_embedding)
SHARED_EMBEDDING_FILE = "shared_embedding.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE)
# the same model as a GGUF file, beside the checkpoint: what llama.cpp's engine loads
GGUF_FILE = "model.gguf"
