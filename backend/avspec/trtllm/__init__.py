"""The TensorRT-LLM path: target checkpoint export and the per-sequence engine requests."""
