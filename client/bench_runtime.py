#!/usr/bin/env python3
"""The runtime's step on a real target, variant against variant, side by side (issue 21, part 3).

Speed: each variant (a runtime source tree, a serving precision, options) runs in its own worker
process with one torch thread, the model loaded and a KV cache holding as many sequences as the
largest shape has rows, each `--context` positions long. The parent asks the workers in turn
for one sample of a shape (rows x new tokens per row, `--shapes`): the fastest of `--repeat`
back-to-back `forward_cached` calls, each rolled back after (the machine is shared: a call
another process interrupted says little about the code). Variants thus interleave sample by
sample and share the machine's load alike; each cell is the median of `--rounds` samples, with
its ratio to the reference variant (the first unless `--reference` names another).

A variant is `LABEL=SOURCE:PRECISION[+OPTION...]`:
- SOURCE `worktree` (this checkout's backend/), `rev:<commit>` (that commit's backend/avspec,
  extracted with `git archive`), or a directory holding an `avspec` package;
- PRECISION a stage `dtype` value (`float32`, `bfloat16`; since issue 21 also `auto`, `int8`,
  `int4`: avspec.runtime.precision);
- OPTION `g64` (int4 in groups of 64 inputs instead of 32), `unfused` (q/k/v and gate/up as
  separate products: what fusing them saves), `compile` (torch.compile of each block's
  projection and MLP and of the head, dynamic shapes; the worker's warm-up time includes the
  compilation).

Accuracy (`--accuracy`): the worktree runtime in each precision against float32 over
`--accuracy-tokens` positions of real text (the project's docs, tokenized by the model's
tokenizer, in 128-token windows fed 8 tokens per call, as verification feeds them): max
|logit difference|, top-1 agreement, mean and max KL(fp32 || p).

Writes the JSON to `--out` (default bench/runtime/runtime.json).

    .venv/bin/python client/bench_runtime.py --rounds 9 --repeat 3
    .venv/bin/python client/bench_runtime.py --no-speed --accuracy bfloat16 int8 int4 \
        --out bench/runtime/accuracy.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 1), (1, 9), (16, 1), (64, 1), (64, 9))
BASELINE_REV = "c6940c14b30e0bc50ec5e71ab4495773b6850bd9"  # the runtime before issue 21's work
DEFAULT_VARIANTS = (
    f"bf16 before=rev:{BASELINE_REV}:bfloat16",
    f"fp32 before=rev:{BASELINE_REV}:float32",
    "bf16 now=worktree:bfloat16",
    "bf16 now, unfused=worktree:bfloat16+unfused",
    "fp32 now=worktree:float32",
    "int8=worktree:int8",
    "int4 g32=worktree:int4",
    "int4 g64=worktree:int4+g64",
)
TEXT_FILES = ("README.md", "docs/architecture.md", "docs/serving.md", "docs/benchmarks.md")


@dataclass
class Variant:
    """One column of the comparison: where the runtime comes from, its precision, options."""

    label: str
    source: str
    precision: str
    options: tuple[str, ...] = ()
    times_ms: dict[str, list[float]] = field(default_factory=dict)
    info: dict = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> Variant:
        label, _, rest = text.partition("=")
        source, _, spec = rest.rpartition(":")
        precision, *options = spec.split("+")
        if not label or not source or not precision:
            raise ValueError(f"variant {text!r} is not LABEL=SOURCE:PRECISION[+OPTION...]")
        return cls(label, source, precision, tuple(options))


def source_path(source: str, scratch: Path) -> Path:
    """The directory to put first on a worker's sys.path for `source` (see the module doc)."""
    if source == "worktree":
        return ROOT / "backend"
    if source.startswith("rev:"):
        rev = source.removeprefix("rev:")
        target = scratch / rev
        if not target.exists():
            archive = subprocess.run(
                ["git", "-C", str(ROOT), "archive", rev, "backend/avspec"],
                check=True, capture_output=True,
            ).stdout  # fmt: skip
            target.mkdir(parents=True)
            with tempfile.TemporaryFile() as tmp:
                tmp.write(archive)
                tmp.seek(0)
                with tarfile.open(fileobj=tmp) as tar:
                    tar.extractall(target, filter="data")
        return target / "backend"
    return Path(source)


# ---------------------------------------------------------------- worker side


def load_variant(model_dir: str, precision: str, max_length: int, options: list[str]):
    """The model of a worker: the new loader where the source has one, else float dtypes."""
    try:
        from avspec.runtime.precision import load_served_model
    except ImportError:  # a source from before issue 21: float dtypes only
        from avspec.runtime.model_dir import load_model

        return load_model(model_dir, "cpu", dtype=getattr(torch, precision), max_length=max_length)
    group_size = 64 if "g64" in options else 32
    return load_served_model(model_dir, "cpu", precision, max_length, group_size=group_size)


class _Unfused(torch.nn.Module):
    """A fused projection computed as separate products over its row blocks, concatenated."""

    def __init__(self, linear: torch.nn.Module, sizes: list[int]) -> None:
        super().__init__()
        self.parts = [w.contiguous() for w in linear.weight.detach().split(sizes)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.nn.functional.linear(x, w) for w in self.parts], dim=-1)


def unfuse(model) -> None:
    config = model.config
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for block in model.blocks:
        block.qkv = _Unfused(block.qkv, [q, kv, kv])
        block.mlp_in = _Unfused(block.mlp_in, [config.intermediate_size] * 2)


def compile_blocks(model) -> None:
    for block in model.blocks:
        block.project = torch.compile(block.project, dynamic=True)
        block.mlp = torch.compile(block.mlp, dynamic=True)
    model.logits = torch.compile(model.logits, dynamic=True)


def worker(spec: dict) -> None:
    """Serve timing requests on stdin (JSON lines {"rows", "tokens"}) until EOF."""
    sys.path.insert(0, spec["path"])
    torch.set_num_threads(1)
    start = time.perf_counter()
    context, rows_max, tokens_max = spec["context"], spec["rows_max"], spec["tokens_max"]
    model = load_variant(spec["model"], spec["precision"], context + tokens_max, spec["options"])
    load_s = time.perf_counter() - start
    if "unfused" in spec["options"]:
        unfuse(model)
    if "compile" in spec["options"]:
        compile_blocks(model)
    cache = model.new_cache(rows_max, context + tokens_max)
    for seq_id in range(rows_max):
        cache.allocate(seq_id)
        cache.advance([seq_id], [context])  # keys and values left at zero: timing only
    generator = torch.Generator().manual_seed(0)

    def step(rows: int, tokens: int) -> float:
        ids = torch.randint(0, model.config.vocab_size, (rows * tokens,), generator=generator)
        begin = time.perf_counter()
        with torch.inference_mode():
            model.forward_cached(cache, list(range(rows)), ids, [tokens] * rows)
        elapsed = time.perf_counter() - begin
        for seq_id in range(rows):
            cache.rollback(seq_id, context)
        return elapsed * 1e3

    start = time.perf_counter()
    for rows, tokens in spec["shapes"]:  # warm-up (and compilation) of every shape
        step(rows, tokens)
    warm_s = time.perf_counter() - start
    dtype = str(model.embed.weight.dtype).removeprefix("torch.")
    print(json.dumps({"load_s": load_s, "warmup_s": warm_s, "activations": dtype}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        ms = min(step(request["rows"], request["tokens"]) for _ in range(request["repeat"]))
        print(json.dumps({"ms": ms}), flush=True)


# ---------------------------------------------------------------- parent side


def run_speed(args: argparse.Namespace, variants: list[Variant], scratch: Path) -> None:
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    workers = []
    for variant in variants:
        spec = {
            "path": str(source_path(variant.source, scratch)),
            "model": str(args.model),
            "precision": variant.precision,
            "options": list(variant.options),
            "context": args.context,
            "rows_max": max(r for r, _ in shapes),
            "tokens_max": max(t for _, t in shapes),
            "shapes": shapes,
        }
        process = subprocess.Popen(
            [sys.executable, __file__, "--worker", json.dumps(spec)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
        )  # fmt: skip
        variant.info = json.loads(process.stdout.readline())  # one at a time: loads don't overlap
        print(f"{variant.label}: {variant.info}", file=sys.stderr, flush=True)
        workers.append(process)
    for round_index in range(args.rounds):
        for rows, tokens in shapes:
            turn = round_index % len(variants)  # rotate who goes first
            for i in [*range(turn, len(variants)), *range(turn)]:
                process = workers[i]
                request = {"rows": rows, "tokens": tokens, "repeat": args.repeat}
                process.stdin.write(json.dumps(request) + "\n")
                process.stdin.flush()
                ms = json.loads(process.stdout.readline())["ms"]
                variants[i].times_ms.setdefault(f"{rows}x{tokens}", []).append(ms)
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    for process in workers:
        process.stdin.close()
        process.wait()


def speed_table(variants: list[Variant], reference: Variant, statistic=statistics.median) -> str:
    """Markdown: one row per variant, `statistic` of each shape's samples (ms) and its ratio
    to the reference's."""
    shapes = list(reference.times_ms)
    head = "| variant | " + " | ".join(f"{s} ms (ratio)" for s in shapes) + " |"
    lines = [head, "|---" * (len(shapes) + 1) + "|"]
    for v in variants:
        cells = []
        for s in shapes:
            ms, ref = statistic(v.times_ms[s]), statistic(reference.times_ms[s])
            cells.append(f"{ms:,.1f} ({ms / ref:.2f})")
        lines.append(f"| {v.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_accuracy(args: argparse.Namespace, precisions: list[str]) -> dict:
    """Each precision's logits against float32 over windows of real text (worktree runtime)."""
    sys.path.insert(0, str(ROOT / "backend"))
    from avspec.runtime.model_dir import load_tokenizer
    from avspec.runtime.precision import load_served_model

    torch.set_num_threads(1)
    text = "\n\n".join((ROOT / name).read_text() for name in TEXT_FILES)
    ids = load_tokenizer(args.model).encode(text)
    windows = torch.tensor(ids[: args.accuracy_tokens]).split(128)

    def logits_of(precision: str) -> torch.Tensor:
        """Each window fed 8 tokens per `forward_cached` call, as verification feeds them
        (8 tokens run the quantized kernels, not the dequantized path)."""
        model = load_served_model(args.model, "cpu", precision, max_length=128)
        out = []
        with torch.inference_mode():
            for window in windows:
                cache = model.new_cache(1, 128)
                cache.allocate(0)
                for chunk in window.split(8):
                    out.append(model.forward_cached(cache, [0], chunk, [len(chunk)]).float())
        return torch.cat(out)

    reference = logits_of("float32")
    log_ref = torch.log_softmax(reference, dim=-1)
    results = {}
    for precision in precisions:
        logits = logits_of(precision)
        log_p = torch.log_softmax(logits, dim=-1)
        kl = (log_ref.exp() * (log_ref - log_p)).sum(-1)
        results[precision] = {
            "positions": len(reference),
            "max_abs_logit_diff": (logits - reference).abs().max().item(),
            "top1_agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "mean_kl": kl.mean().item(),
            "max_kl": kl.max().item(),
        }
        print(f"{precision}: {results[precision]}", file=sys.stderr, flush=True)
    return results


def accuracy_table(results: dict) -> str:
    lines = [
        "| precision | positions | max abs logit diff | top-1 agreement | mean KL | max KL |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['positions']} | {r['max_abs_logit_diff']:.3f} | "
            f"{r['top1_agreement']:.3f} | {r['mean_kl']:.2e} | {r['max_kl']:.2e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "target")
    parser.add_argument("--variant", action="append", help="LABEL=SOURCE:PRECISION[+OPTION]")
    parser.add_argument("--reference", help="label of the ratio's reference (default: first)")
    parser.add_argument("--shapes", default=",".join(f"{r}x{t}" for r, t in SHAPES))
    parser.add_argument("--context", type=int, default=128, help="cached positions per row")
    parser.add_argument("--rounds", type=int, default=7, help="samples per cell")
    parser.add_argument(
        "--repeat", type=int, default=3, help="back-to-back calls per sample; a sample is their min"
    )
    parser.add_argument("--accuracy", nargs="*", help="precisions to compare with float32")
    parser.add_argument("--accuracy-tokens", type=int, default=512)
    parser.add_argument("--no-speed", action="store_true", help="accuracy only")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "runtime" / "runtime.json")
    args = parser.parse_args(argv)
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    if not (args.model / "config.json").is_file():
        parser.error(f"no model at {args.model}: `make models`, or pass --model DIR")
    result: dict = {
        "model": str(args.model),
        "context": args.context,
        "threads": 1,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "load_average_start": os.getloadavg(),
    }
    if not args.no_speed:
        variants = [Variant.parse(v) for v in args.variant or DEFAULT_VARIANTS]
        reference = next((v for v in variants if v.label == args.reference), variants[0])
        with tempfile.TemporaryDirectory() as scratch:
            run_speed(args, variants, Path(scratch))
        print(
            f"\nms per step, median of {args.rounds} samples (each the best of {args.repeat} "
            f"calls); ratio to {reference.label!r}\n"
        )
        print(speed_table(variants, reference))
        print("\nfastest sample (the least disturbed by other work on the machine)\n")
        print(speed_table(variants, reference, min))
        result["rounds"] = args.rounds
        result["repeat"] = args.repeat
        result["reference"] = reference.label
        result["variants"] = [
            {
                "label": v.label, "source": v.source, "precision": v.precision,
                "options": list(v.options), "worker": v.info,
                "median_ms": {s: statistics.median(t) for s, t in v.times_ms.items()},
                "min_ms": {s: min(t) for s, t in v.times_ms.items()},
                "times_ms": v.times_ms,
            }
            for v in variants
        ]  # fmt: skip
    if args.accuracy is not None:
        accuracy = run_accuracy(args, args.accuracy or ["bfloat16", "int8", "int4"])
        print("\n" + accuracy_table(accuracy))
        result["accuracy"] = accuracy
    result["load_average_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
