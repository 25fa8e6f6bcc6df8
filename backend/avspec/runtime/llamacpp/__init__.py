"""llama.cpp's engine (ggml) as a runtime of both stages, through `llama-cpp-python`'s C API.

The stages (avspec.engine) drive a model through two calls, `forward_cached` over a packed
ragged batch and `logits`, and a KV cache through `has / allocate / free / length / rollback`.
This package gives a GGUF file the same two faces, so the verifier, estimator, budget, drafting
plan and rejection sampling run unchanged on either runtime. One module per job:

- `binding`: import `llama_cpp` (built for this CPU by `make llamacpp`), initialise the backend
  once, route ggml's log into Python's logging;
- `sequences`: the sequences' KV pool, one `llama_memory` shared by every sequence (request
  ids mapped to llama.cpp's sequence ids, rejected drafts removed with `llama_memory_seq_rm`);
- `model`: load the file, one `llama_decode` per call over all rows, logits only at the
  positions asked for, handed to torch as a view of llama.cpp's buffer (no per-row copy).
"""
