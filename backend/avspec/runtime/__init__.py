"""The model runtime: transformer, per-sequence KV cache, tokenizer, model directories."""
