"""Setting a deployment up: fetch and convert the target, write the draft as a GGUF, build
llama.cpp's binding, requantize, check a converted file, combine replicas' estimator snapshots.
"""
