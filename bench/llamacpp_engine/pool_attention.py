#!/usr/bin/env python3
"""One target decode on llama.cpp's engine by KV layout and attention path (issue 32).

    cd bench/llamacpp_engine && ../../.venv/bin/python pool_attention.py > pool_attention.txt

85 sequences of 128 cached positions (the cost profiler's ladder: 1 + 4 + 16 + 64), then one
`forward_cached` of 1, 16 and 64 rows x 9 new tokens (logits at each; rolled back after), median
of 3 after one untimed, 2 threads, the target's published Q4_1 file. Layouts: one pool shared by
every sequence (`unified`, what the stages serve) or a stream per sequence; attention: ggml's
plain path or its flash attention. Then the logits of both attention paths on 8 chat prompts of
workloads/chat.jsonl against each other and against the torch runtime in float32 on the same
weights (models/target): KL divergence per position and argmax agreement.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

from avspec.runtime.cpu_features import read_cpu_flags
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.model_dir import load_tokenizer
from avspec.runtime.precision import load_served_model

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / "models" / "target" / "model.gguf"
SEQUENCES, CONTEXT, K = 85, 128, 9


def decode_ms(flash: bool, unified: bool) -> dict[int, float]:
    settings = EngineSettings(
        max_sequences=SEQUENCES, pool_tokens=SEQUENCES * (CONTEXT + K + 2),
        max_outputs=64 * K, threads=2, flash_attention=flash, unified=unified,
    )  # fmt: skip
    model = GGUFModel(GGUF, settings)
    pool = model.new_cache()
    generator = torch.Generator().manual_seed(0)
    for i in range(SEQUENCES):
        pool.allocate(i)
        ids = torch.randint(100, 5000, (CONTEXT,), generator=generator, dtype=torch.int32)
        model.forward_cached(pool, [i], ids, [CONTEXT], at=torch.tensor([CONTEXT - 1]))

    def step(rows: int) -> float:
        ids = list(range(rows))
        tokens = torch.randint(100, 5000, (rows * K,), generator=generator, dtype=torch.int32)
        begin = time.perf_counter()
        model.forward_cached(pool, ids, tokens, [K] * rows, at=None)
        elapsed = (time.perf_counter() - begin) * 1000
        for i in ids:
            pool.rollback(i, CONTEXT)
        return elapsed

    out = {}
    for rows in (1, 16, 64):
        step(rows)
        out[rows] = statistics.median(step(rows) for _ in range(3))
    return out


def chat_logits(flash: bool, prompts: list[torch.Tensor]) -> list[torch.Tensor]:
    rows = len(prompts)
    settings = EngineSettings(max_sequences=rows, pool_tokens=rows * 512, max_outputs=512,
                              threads=2, flash_attention=flash)  # fmt: skip
    model = GGUFModel(GGUF, settings)
    pool = model.new_cache()
    out = []
    for i, ids in enumerate(prompts):
        pool.allocate(i)
        out.append(model.forward_cached(pool, [i], ids, [len(ids)], at=None).float().clone())
    return out


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, float]:
    kl, agree = [], 0
    for x, y in zip(a, b, strict=True):
        lx, ly = x.log_softmax(-1), y.log_softmax(-1)
        kl.append((lx.exp() * (lx - ly)).sum(-1))
        agree += int((x.argmax(-1) == y.argmax(-1)).sum())
    kls = torch.cat(kl)
    return {"positions": len(kls), "kl_median": float(kls.median()),
            "kl_p99": float(kls.quantile(0.99)), "kl_max": float(kls.max()),
            "argmax_agreement": agree / len(kls)}  # fmt: skip


@torch.inference_mode()
def main() -> None:
    flags = sorted(f for f in read_cpu_flags() if f.startswith(("avx", "amx")))
    print(f"host: {platform.processor() or platform.machine()}, flags {' '.join(flags)}")
    print(f"decode ms, {SEQUENCES} sequences of {CONTEXT} positions cached, rows x {K} tokens")
    for unified, flash in ((True, False), (True, True), (False, False), (False, True)):
        times = decode_ms(flash, unified)
        layout = "one shared pool " if unified else "a stream per seq"
        line = ", ".join(f"{rows} x {K}: {ms:,.0f}" for rows, ms in times.items())
        print(f"  {layout}, {'flash' if flash else 'plain'} attention: {line}", flush=True)
    tok = load_tokenizer(ROOT / "models" / "target")
    lines = (ROOT / "workloads" / "chat.jsonl").read_text().splitlines()[:8]
    texts = [json.loads(line)["prompt"] for line in lines]
    prompts = [torch.tensor(tok.encode(t)[:400], dtype=torch.int32) for t in texts]
    plain, flash = chat_logits(False, prompts), chat_logits(True, prompts)
    reference = load_served_model(ROOT / "models" / "target", "cpu", "float32")
    exact = [reference(p[None].long())[0].float() for p in prompts]
    for name, a, b in (("plain vs flash", plain, flash), ("torch fp32 vs plain", exact, plain),
                       ("torch fp32 vs flash", exact, flash)):  # fmt: skip
        c = compare(a, b)
        print(f"  {name}: {c['positions']} positions, KL median {c['kl_median']:.2e}, p99 "
              f"{c['kl_p99']:.2e}, max {c['kl_max']:.2e}, argmax agreement "
              f"{c['argmax_agreement']:.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
