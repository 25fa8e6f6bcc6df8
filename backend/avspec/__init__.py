"""Speculative decoding with adaptive verification (AV) for Triton Inference Server."""
