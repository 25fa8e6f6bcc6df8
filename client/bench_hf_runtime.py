#!/usr/bin/env python3
"""The Hugging Face loader and runtime against `transformers`, measured (issue: own model pair).

1. Peak resident memory while loading a generated random LlamaForCausalLM checkpoint
   (`--load-mb`, fp32 safetensors): the growth of the process's peak RSS during
   `load_hf_model`, over the weights' size. Run in a fresh subprocess so nothing else counts.
2. Greedy decoding of one request, no speculation, on a tiny random Llama (`--tokens` new
   tokens after a 16-token prompt): the project's runtime (`forward_cached`, one token per call,
   what the target stage runs) against `transformers`' own `generate` with its KV cache, side by
   side, alternating `--rounds` times; reports tokens/s of each and their ratio, and checks both
   produce the same tokens.

Needs the test-only dependency `transformers`. Writes nothing outside a temporary directory.

    .venv/bin/python client/bench_hf_runtime.py --load-mb 500 --tokens 64 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# VmHWM (peak RSS) from /proc: getrusage's ru_maxrss survives exec, so a child would report
# its parent's peak.
PEAK_SCRIPT = """
import json, sys, torch
def peak_kib():
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmHWM"))
from avspec.runtime.hf_checkpoint import load_hf_model
torch.set_num_threads(1)
before = peak_kib()
model, info = load_hf_model(sys.argv[1])
after = peak_kib()
print(json.dumps({"before_kib": before, "after_kib": after, "parameters": info.num_parameters}))
"""


def llama_config(load_mb: int):
    """A Llama config whose fp32 weights take about `load_mb` MB (width 1024, vocab 32000)."""
    from transformers import LlamaConfig

    per_layer = 4 * 1024 * 1024 + 3 * 1024 * 2816  # attention + SwiGLU MLP
    embeddings = 2 * 32000 * 1024  # untied input and output embeddings
    layers = max(1, round((load_mb * 1e6 / 4 - embeddings) / per_layer))
    return LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip


def peak_memory(directory: Path) -> dict:
    """Peak RSS growth of a fresh process loading `directory`, against the weights' bytes."""
    weights = sum(p.stat().st_size for p in directory.glob("*.safetensors"))
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(directory)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    numbers = json.loads(out.stdout.strip().splitlines()[-1])
    growth = (numbers["after_kib"] - numbers["before_kib"]) * 1024
    return {"weights_mb": weights / 1e6, "peak_growth_mb": growth / 1e6, "ratio": growth / weights}


def decode_ours(model, prompt: list[int], tokens: int) -> list[int]:
    cache = model.new_cache(1, len(prompt) + tokens + 1)
    cache.allocate(0)
    logits = model.forward_cached(cache, [0], torch.tensor(prompt), [len(prompt)])[-1]
    out = []
    for _ in range(tokens):
        token = int(logits.argmax())
        out.append(token)
        logits = model.forward_cached(cache, [0], torch.tensor([token]), [1])[-1]
    return out


def decode_transformers(model, prompt: list[int], tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    generated = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    return generated[0, len(prompt) :].tolist()


def speed(directory: Path, tokens: int, rounds: int) -> dict:
    from transformers import AutoModelForCausalLM

    from avspec.runtime.hf_checkpoint import load_hf_model

    ours, _ = load_hf_model(directory)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    prompt = list(range(3, 19))
    times: dict[str, list[float]] = {"runtime": [], "transformers": []}
    outputs = {}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, decode, model in (
                ("runtime", decode_ours, ours), ("transformers", decode_transformers, theirs),
            ):  # fmt: skip
                start = time.perf_counter()
                outputs[name] = decode(model, prompt, tokens)
                times[name].append(time.perf_counter() - start)
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    return {
        "tokens": tokens,
        "rounds": rounds,
        "runtime_tokens_per_s": rate["runtime"],
        "transformers_tokens_per_s": rate["transformers"],
        "ratio": rate["runtime"] / rate["transformers"],
        "same_tokens": outputs["runtime"] == outputs["transformers"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--load-mb", type=int, default=500, help="checkpoint size to load")
    parser.add_argument("--tokens", type=int, default=64, help="new tokens per decode")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed decodes")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        big = Path(tmp) / "big"
        LlamaForCausalLM(llama_config(args.load_mb)).save_pretrained(big, safe_serialization=True)
        memory = peak_memory(big)
        tiny = Path(tmp) / "tiny"
        LlamaForCausalLM(
            LlamaConfig(
                vocab_size=512,
                hidden_size=128,
                intermediate_size=344,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=256,
            )  # fmt: skip
        ).save_pretrained(tiny, safe_serialization=True)
        rates = speed(tiny, args.tokens, args.rounds)
    result = {"load": memory, "greedy": rates, "threads": args.threads}
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
