"""Serving: the Triton server launcher and the Triton-free helpers of the model.py adapters."""
