"""Greedy answers to the 8 chat prompts of `avspec.tools.setup.check_gguf_target`, by serving
precision, on the cached path as served (one `forward_cached` call per token after the prompt),
against float32 on the same directory: where each precision's answer parts from float32's.

    .venv/bin/python bench/runtime/greedy_by_precision.py --model <fp32 conversion dir> \
        --out bench/runtime/greedy_by_precision.json
"""

import argparse
import json
from pathlib import Path

import torch
from transformers import AutoTokenizer

from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.precision import load_served_model
from avspec.tools.setup.check_gguf_target import CHAT_PROMPTS, MAX_NEW_TOKENS, parting

PRECISIONS = ("float32", "bfloat16", "int4", "w8a8")


@torch.inference_mode()
def cached_greedy(model, ids: list[int], eos: frozenset[int]) -> list[int]:
    cache = model.new_cache(1, 512)
    cache.allocate(0)
    logits = model.forward_cached(cache, [0], torch.tensor(ids), [len(ids)])
    out: list[int] = []
    for _ in range(MAX_NEW_TOKENS):
        token = int(logits[-1].argmax())
        out.append(token)
        if token in eos:
            break
        logits = model.forward_cached(cache, [0], torch.tensor([token]), [1])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    renderer = AutoTokenizer.from_pretrained(str(args.model))
    tokenizer = load_tokenizer(args.model)
    prompts = [
        list(
            renderer.apply_chat_template(
                [{"role": "user", "content": p}], add_generation_prompt=True
            )
        )
        for p in CHAT_PROMPTS
    ]
    answers = {}
    for precision in PRECISIONS:
        model = load_served_model(args.model, "cpu", precision, max_length=512)
        answers[precision] = [cached_greedy(model, ids, tokenizer.eos_ids) for ids in prompts]
    rows = []
    for i, prompt in enumerate(CHAT_PROMPTS):
        row = {"prompt": prompt}
        for precision in PRECISIONS:
            row[precision] = tokenizer.decode(answers[precision][i])
            row[f"{precision}_parts_at"] = parting(answers[precision][i], answers["float32"][i])
        rows.append(row)
    summary = {
        p: sum(r[f"{p}_parts_at"] is None for r in rows) for p in PRECISIONS if p != "float32"
    }
    args.out.write_text(json.dumps({"equal_to_float32": summary, "rows": rows}, indent=1) + "\n")
    print(json.dumps(summary))
    for row in rows:
        print(row["prompt"], {p: row[f"{p}_parts_at"] for p in PRECISIONS[1:]})


if __name__ == "__main__":
    main()
