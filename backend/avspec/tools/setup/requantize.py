"""llama.cpp's requantization of the target's GGUF, and how far it moves the model.

    python -m avspec.tools.setup.requantize --type Q4_0          # models/target/model.Q4_0.gguf
    make models QUANT=Q4_0 && make serve QUANT=Q4_0         # the same, then served

The target is served as published by default (SmolLM2's Q4_1 file). A user may trade some of
the model for speed: ggml repacks Q4_0 blocks for its CPU matrix kernels, which made a 64-row
decode 2.5x faster than Q4_1 on an AVX-512 host. This writes the requantized file with
`llama_model_quantize` (llama.cpp's own code, `allow_requantize`: the blocks are dequantized
and quantized again, so the error adds to the published file's) and measures its agreement with
the original on held-out chat: the prompts of workloads/chat.jsonl (not in the draft's training
data) through both files on llama.cpp's engine, logits at every position, and per position the
KL divergence original || requantized and whether the argmax agrees. The figures go to
models/QUANTIZATION.md (the requantized file's model card) and `<out>.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch
from tqdm import tqdm

from avspec.runtime.cpu_features import read_cpu_flags
from avspec.runtime.gguf.reader import GGUFFile
from avspec.runtime.hf_files import GGUF_FILE
from avspec.runtime.llamacpp.binding import llama_cpp
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.model_dir import load_tokenizer

# The types a user may name, as llama.cpp's ftype constants.
TYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0",
         "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # fmt: skip
PROMPT_TOKENS = 384  # each prompt's first tokens (the chat prompts are shorter)


def file_type(path: Path) -> str:
    """The GGUF's `general.file_type` as llama.cpp names it (Q4_1, Q8_0, ...)."""
    value = GGUFFile(path).value("general.file_type", None)
    lib = llama_cpp()
    names = [n for n in dir(lib) if n.startswith("LLAMA_FTYPE_MOSTLY_")]
    found = [n for n in names if getattr(lib, n) == value]
    return found[0].removeprefix("LLAMA_FTYPE_MOSTLY_") if found else f"file type {value}"


def requantized_name(kind: str) -> str:
    """model.Q4_0.gguf beside model.gguf."""
    return f"model.{kind}.gguf"


def requantize(source: Path, output: Path, kind: str, threads: int = 0) -> None:
    """Write `source` requantized to `kind` at `output` (a temporary name, then renamed)."""
    if kind not in TYPES:
        raise ValueError(f"unknown quantization {kind!r}: one of {', '.join(TYPES)}")
    if not source.is_file():
        raise FileNotFoundError(f"{source}: no such GGUF file")
    lib = llama_cpp()
    params = lib.llama_model_quantize_default_params()
    params.ftype = getattr(lib, TYPES[kind])
    params.nthread = threads
    params.allow_requantize = True
    partial = output.with_name(output.name + ".partial")
    status = lib.llama_model_quantize(
        str(source).encode(), str(partial).encode(), ctypes.byref(params)
    )
    if status != 0 or not partial.is_file():
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize {source} -> {kind} failed (status {status})")
    partial.replace(output)


def chat_prompts(tokenizer_dir: Path, workload: Path, count: int) -> list[list[int]]:
    """The first `count` prompts of a chat workload, tokenized, cut at PROMPT_TOKENS."""
    tokenizer = load_tokenizer(tokenizer_dir)
    lines = [line for line in workload.read_text().splitlines() if line.strip()][:count]
    return [tokenizer.encode(json.loads(line)["prompt"])[:PROMPT_TOKENS] for line in lines]


@torch.inference_mode()
def agreement(original: Path, requantized: Path, prompts: list[list[int]]) -> dict[str, float]:
    """KL(original || requantized) per position (median, p99, max, mean) and argmax agreement
    over every position of `prompts`, each prompt decoded alone by both files."""
    settings = EngineSettings(max_sequences=1, pool_tokens=PROMPT_TOKENS + 8,
                              max_outputs=PROMPT_TOKENS)  # fmt: skip
    models = [GGUFModel(original, settings), GGUFModel(requantized, settings)]
    kls, agree = [], 0
    for ids in tqdm(prompts, desc="agreement", unit="prompt"):
        logits = []
        for model in models:
            pool = model.new_cache()
            pool.allocate(0)
            tokens = torch.tensor(ids, dtype=torch.int32)
            logits.append(model.forward_cached(pool, [0], tokens, [len(ids)]).float().clone())
        reference, other = (x.log_softmax(-1) for x in logits)
        kls.append((reference.exp() * (reference - other)).sum(-1))
        agree += int((reference.argmax(-1) == other.argmax(-1)).sum())
    kl = torch.cat(kls)
    return {
        "prompts": len(prompts), "positions": len(kl), "kl_median": float(kl.median()),
        "kl_p99": float(kl.quantile(0.99)), "kl_max": float(kl.max()), "kl_mean": float(kl.mean()),
        "argmax_agreement": agree / len(kl),
    }  # fmt: skip


def decode_ms(path: Path, rows: int, repeats: int = 3) -> float:
    """Median ms of one decode of `rows` sequences x 1 token after 128 cached positions each."""
    settings = EngineSettings(max_sequences=rows, pool_tokens=rows * 136, max_outputs=rows)
    model = GGUFModel(path, settings)
    pool = model.new_cache()
    generator = torch.Generator().manual_seed(0)
    for i in range(rows):
        pool.allocate(i)
        ids = torch.randint(100, 5000, (128,), generator=generator, dtype=torch.int32)
        model.forward_cached(pool, [i], ids, [128], at=torch.tensor([127]))
    times = []
    for _ in range(repeats + 1):
        tokens = torch.randint(100, 5000, (rows,), generator=generator, dtype=torch.int32)
        begin = time.perf_counter()
        model.forward_cached(pool, list(range(rows)), tokens, [1] * rows)
        times.append((time.perf_counter() - begin) * 1000)
        for i in range(rows):
            pool.rollback(i, 128)
    return sorted(times[1:])[len(times[1:]) // 2]


def card(report: dict) -> str:
    """models/QUANTIZATION.md from a report."""
    a = report["agreement"]
    speed = ", ".join(
        f"{rows} row{'s' if rows != '1' else ''}: {o:.1f} -> {q:.1f} ms"
        for rows, (o, q) in report["decode_ms"].items()
    )
    return f"""# The requantized target ({report["type"]})

`{report["output"]}`: SmolLM2-135M-Instruct's published `{report["source_type"]}` file
requantized to {report["type"]} by llama.cpp's `llama_model_quantize` (`make models
QUANT={report["type"]}`; served with `make serve QUANT={report["type"]}`, llama.cpp's engine).
The published file stays the default: this one is smaller and faster on ggml's CPU kernels,
and it is a different model, by as much as the figures below say. Speculative decoding stays
exact with respect to whichever file the target serves.

Command: `{report["command"]}` ({report["date"]}; {report["host"]}).

## Agreement with the published file on held-out chat

The first {a["prompts"]} prompts of `workloads/chat.jsonl` (ChatML, not in the draft's training
data), up to {PROMPT_TOKENS} tokens each, {a["positions"]:,} positions; each file's logits at every
position on llama.cpp's engine:

| KL(published \\|\\| requantized) per position | value |
|---|---|
| median | {a["kl_median"]:.4f} |
| mean | {a["kl_mean"]:.4f} |
| 99th percentile | {a["kl_p99"]:.4f} |
| max | {a["kl_max"]:.4f} |
| argmax agreement | {a["argmax_agreement"]:.2%} |

## Speed

One decode of rows x 1 token after 128 cached positions each, llama.cpp's engine, every core,
median of 3 (published -> requantized): {speed}.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="Q4_0", choices=sorted(TYPES))
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--workload", type=Path, default=Path("workloads/chat.jsonl"))
    parser.add_argument("--prompts", type=int, default=32, help="held-out chat prompts compared")
    parser.add_argument("--card", type=Path, default=Path("models/QUANTIZATION.md"))
    parser.add_argument("--force", action="store_true", help="requantize an existing file again")
    args = parser.parse_args(argv)
    source = args.target / GGUF_FILE
    output = args.target / requantized_name(args.type)
    if output.is_file() and not args.force:
        print(f"[requantize] {output} exists (--force to write it again)")
        return 0
    begin = time.perf_counter()
    print(f"[requantize] {source} -> {output} ({args.type})", flush=True)
    requantize(source, output, args.type)
    print(f"[requantize] written in {time.perf_counter() - begin:.0f} s", flush=True)
    prompts = chat_prompts(args.target, args.workload, args.prompts)
    agreed = agreement(source, output, prompts)
    speed = {str(rows): (decode_ms(source, rows), decode_ms(output, rows)) for rows in (1, 16, 64)}
    flags = " ".join(sorted(f for f in read_cpu_flags() if f.startswith(("avx", "amx"))))
    report = {
        "type": args.type, "output": str(output), "source": str(source),
        "source_type": file_type(source),
        "command": " ".join(["python -m avspec.tools.setup.requantize", *(argv or sys.argv[1:])]),
        "date": datetime.now(UTC).date().isoformat(),
        "host": f"{platform.machine()}, {flags}", "agreement": agreed, "decode_ms": speed,
        "sizes_bytes": {"source": source.stat().st_size, "output": output.stat().st_size},
    }  # fmt: skip
    output.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.card.write_text(card(report))
    print(json.dumps(agreed, indent=2))
    print(f"[requantize] wrote {output}, {output.with_suffix('.json')} and {args.card}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
