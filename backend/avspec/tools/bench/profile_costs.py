"""Measure the step cost (draft pass by rows, verify by tokens) of a model pair; write the file.

The verifier's budget and the draft's depth (spec section 4, avspec.av.drafting.plan_step) price a
step as overhead + draft passes + verify, with StepCost (avspec.av.step_cost). This script times
the real draft and target stages (avspec.tools.bench.profiler): each point `--repeats` times after
`--warmup` untimed calls, the median per size, an isotonic fit weighted by the samples; and
writes the step-cost file (avspec.av.cost_file, format avspec-step-cost/1) with the raw samples
under "measured". In-process there are no Triton hops: overhead_ms is --overhead-ms (default 0);
measure the served path's with client/profile_serving_costs.py.

Run as `python client/profile_costs.py` or `python -m avspec.tools.bench.profile_costs` (the same
options); the launcher runs it at first start (avspec.serving.host.host_costs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import platform
import shlex
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from avspec.av.cost_file import load_step_cost, save_step_cost
from avspec.av.step_cost import StepCost
from avspec.engine.draft_vocab import resolve_draft_vocab
from avspec.runtime.head import is_head_dir, load_head_dir
from avspec.runtime.hf_files import GGUF_FILE
from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel
from avspec.runtime.precision import PRECISIONS, load_served_model, resolve_precision
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.bench.profiler import (
    WORKLOAD_FILES,
    CostPoints,
    LadderSettings,
    fit_tokens_and_rows,
    profile_draft_pass,
    profile_verify_cost,
    verify_points,
    workload_text,
)
from avspec.tools.train.tiny.train import DRAFT_CONFIG, TARGET_CONFIG


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Sizes: the draft pass is indexed by rows (tokens in one draft forward), verify by "
        "total target tokens (batch * (1 + verified drafts)).",
    )
    parser.add_argument("--target-dir", type=Path, default=Path("models/target"))
    parser.add_argument("--draft-dir", type=Path, default=Path("models/draft"))
    parser.add_argument(
        "--random-pair",
        action="store_true",
        help="profile seeded random-weight models of the default sizes instead of model dirs",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--engine", default="torch", choices=("torch", "llamacpp"),
        help="the stages' runtime: torch (the checkpoints in --dtype) or llamacpp (each "
        "directory's model.gguf on llama.cpp's engine, --engine-threads threads)",
    )  # fmt: skip
    parser.add_argument("--engine-threads", type=int, default=0, help="llamacpp: 0 = every core")
    parser.add_argument(
        "--target-gguf", default=GGUF_FILE,
        help="llamacpp: the target's GGUF file in --target-dir (default %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--no-flash-attention", dest="flash_attention", action="store_false",
        help="llamacpp: ggml's plain attention (the stages' flash_attention: false)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="auto", choices=PRECISIONS,
        help="the served precision (the stages' `dtype` parameter; default auto)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-dtype", default=None, choices=PRECISIONS,
        help="the draft's precision where it differs from --dtype",
    )  # fmt: skip
    parser.add_argument(
        "--max-draft-tokens", type=int, default=8, help="K (default 8): verify ladder 0..K "
        "drafts per sequence; the draft pass is timed as (K passes - 1 pass) / (K - 1)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-rows", "--draft-batch-sizes", dest="draft_rows", default="1,2,4,8,16,32,64",
        help="comma list of rows per draft pass (1, 2, 4, ... up to the max batch)",
    )  # fmt: skip
    parser.add_argument(
        "--verify-batch-sizes", default="1,4,16,64", help="comma list; each verifies 0..K drafts"
    )
    parser.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    parser.add_argument(
        "--text", choices=["workloads", "random"], default="workloads",
        help="the sequences' tokens: the prompts of workloads/chat.jsonl and code.jsonl in the "
        "target's tokenizer (default; what a stage serves), or random ids below 256 (always "
        "with --random-pair). A top-p nucleus is a few tokens long on real text, thousands on "
        "random ids, and the sampling work grows with it",
    )  # fmt: skip
    parser.add_argument(
        "--draft-top-k", type=int, default=0,
        help="the draft model's draft_top_k parameter (0: it warps like the target)",
    )  # fmt: skip
    parser.add_argument(
        "--draft-vocab", default="auto",
        help="the draft model's draft_vocab parameter: auto (default: the draft directory's "
        "draft_vocab.json when it has one), a map file, or '' for the whole vocabulary",
    )  # fmt: skip
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per point")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls per point")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (1 is steadier on a busy box)"
    )
    parser.add_argument(
        "--overhead-ms", type=float, default=0.0,
        help="per-step fixed cost to write (served path hops; 0 in-process)",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, required=True, help="step-cost JSON to write")
    parser.add_argument("--plot", type=Path, default=None, help="also draw the tables (PNG)")
    args = parser.parse_args(argv)
    try:
        args.draft_rows = [int(s) for s in args.draft_rows.split(",") if s]
        args.verify_batch_sizes = [int(s) for s in args.verify_batch_sizes.split(",") if s]
    except ValueError:
        parser.error("--draft-rows and --verify-batch-sizes take comma lists of integers")
    if args.max_draft_tokens < 2:
        parser.error("--max-draft-tokens must be >= 2 (the draft pass is a difference)")
    if not (args.overhead_ms >= 0 and args.overhead_ms < float("inf")):
        parser.error("--overhead-ms must be finite and >= 0")
    return args


def load_pair(args: argparse.Namespace) -> tuple[Any, Any, str]:
    """(target, draft, description) from Hugging Face model dirs in `--dtype`
    (`load_served_model`) or, with --random-pair, seeded random weights of the tiny pair's
    shapes (TARGET_CONFIG and DRAFT_CONFIG of avspec.tools.train.tiny.train)."""
    if args.random_pair:
        models = []
        for seed, config in ((1, TARGET_CONFIG), (2, DRAFT_CONFIG)):
            model = Transformer(config)
            init_weights(model, torch.Generator().manual_seed(seed))
            models.append(model.to(args.device).eval())
        described = (f"target {_shape(TARGET_CONFIG)}", f"draft {_shape(DRAFT_CONFIG)}")
        return models[0], models[1], f"random-weight pair ({', '.join(described)})"
    if args.engine == "llamacpp":
        return _gguf_pair(args)
    target = load_served_model(args.target_dir, args.device, args.dtype)
    draft_dtype = args.draft_dtype or args.dtype
    if is_head_dir(args.draft_dir):
        draft = _head_layers(args, draft_dtype)
    else:
        draft = load_served_model(args.draft_dir, args.device, draft_dtype)
    dtypes = args.dtype if draft_dtype == args.dtype else f"{args.dtype} / {draft_dtype}"
    return target, draft, f"{args.target_dir} + {args.draft_dir} ({dtypes})"


def _head_layers(args: argparse.Namespace, dtype: str) -> Transformer:
    """A draft head's one-block transformer on torch in `dtype`: its pass is timed as that
    block's (the fc's 2 x width -> width product left out) over the same output layer."""
    precision = resolve_precision(dtype, args.device).dtype
    return load_head_dir(args.draft_dir, args.device, precision).layers


def _gguf_pair(args: argparse.Namespace) -> tuple[GGUFModel, Any, str]:
    """Both directories' model.gguf on llama.cpp's engine, sized for the ladder (each size of
    a ladder has sequences of its own, all cached at once). A draft head runs on torch in
    --draft-dtype, and the target is timed as it serves one: emitting its features (llama.cpp
    then computes logits at every token)."""
    rows = max(sum(set(args.draft_rows)), sum(set(args.verify_batch_sizes)))
    widest = max(*args.draft_rows, *args.verify_batch_sizes)
    length = args.context + args.max_draft_tokens + 2
    head = is_head_dir(args.draft_dir)
    settings = EngineSettings(
        max_sequences=rows, pool_tokens=rows * length,
        max_outputs=widest * (args.max_draft_tokens + 1), threads=args.engine_threads,
        flash_attention=args.flash_attention,
        max_length=length,
    )  # fmt: skip
    target = GGUFModel(
        args.target_dir / args.target_gguf, dataclasses.replace(settings, features=head)
    )
    threads = settings.thread_count
    if head:
        layers = _head_layers(args, args.draft_dtype or "auto")
        what = f"{target.path} (llama.cpp, {threads} threads, features) + {args.draft_dir}"
        return target, layers, f"{what} (torch, {args.draft_dtype or 'auto'})"
    draft = GGUFModel(args.draft_dir / GGUF_FILE, settings)
    what = f"{target.path} + {draft.path} (llama.cpp, {threads} threads)"
    return target, draft, what


def _shape(config: TransformerConfig) -> str:
    """layers x width, heads / kv heads, vocab: e.g. "6x320, 5/1 heads, vocab 4096"."""
    return (
        f"{config.num_layers}x{config.width}, {config.num_heads}/{config.num_kv_heads} heads, "
        f"vocab {config.vocab_size}"
    )


def device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(torch.device(device))
    return f"cpu {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def print_table(title: str, unit: str, points: CostPoints, fitted: list[float]) -> None:
    """One line per size: median, fit, samples, interquartile range of the samples."""
    print(f"\n{title}\n{unit:>8}  {'median':>8}  {'fit':>8}  {'n':>3}  {'iqr':>15}")
    samples = points.samples or [[m] for m in points.millis]
    for size, ms, fit, raw in zip(points.sizes, points.millis, fitted, samples, strict=True):
        low, high = _quartiles(raw)
        print(f"{size:>8}  {ms:>8.3f}  {fit:>8.3f}  {len(raw):>3}  {low:>7.3f}-{high:<7.3f}")


def _quartiles(values: list[float]) -> tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4)
    return q[0], q[2]


def _rounded(points: CostPoints) -> dict:
    """to_dict with the samples rounded to 1 us (the file stays readable)."""
    out = points.to_dict()
    if "samples" in out:
        out["samples"] = [[round(x, 4) for x in s] for s in out["samples"]]
    return out


def plot_step_cost(document: dict, path: Path) -> None:
    """Raw samples, medians and the isotonic fit of both tables of a step-cost document."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    measured = document["measured"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (("draft_pass", "draft pass (one forward + sampling)", "rows"),
              ("verify", "verify (target stage)", "target tokens"))  # fmt: skip
    for ax, (name, title, unit) in zip(axes, panels, strict=True):
        raw = measured[name]
        for size, samples in zip(raw["sizes"], raw.get("samples", []), strict=False):
            ax.scatter([size] * len(samples), samples, s=6, color="0.7", zorder=1)
        ax.scatter([], [], s=6, color="0.7", label="samples")
        ax.plot(raw["sizes"], raw["millis"], "o", color="tab:blue", ms=4, label="median", zorder=2)
        batches = sorted({s["batch"] for s in raw.get("shapes", [])})
        for marker, batch in zip("v^<>sdph", batches, strict=False):
            shapes = [s for s in raw["shapes"] if s["batch"] == batch]
            ax.plot([s["size"] for s in shapes], [s["median_ms"] for s in shapes], marker,
                    mfc="none", ms=6, label=f"batch {batch}", zorder=2)  # fmt: skip
        fit = document[name]
        ax.plot(fit["sizes"], fit["millis"], "-", color="tab:red", label="isotonic fit", zorder=3)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))  # 64, not 2^6
        ax.set_xlabel(unit)
        ax.set_ylabel("ms")
        ax.set_title(title, fontsize=10)
        top = max(fit["millis"]) * 1.6
        ax.set_ylim(0, top)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(
        f"{measured.get('models', '')} on {measured.get('device', '')}, "
        f"{measured.get('repeats')} repeats, overhead {document['overhead_ms']:.2f} ms "
        "(samples above the axis clipped)",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def main(
    argv: list[str] | None = None, command: str = "python -m avspec.tools.bench.profile_costs"
) -> int:
    """Profile, print the tables, write `--output`; `command` is how this run is recorded."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    target, draft, what = load_pair(args)
    k = args.max_draft_tokens
    text = None if args.random_pair or args.text == "random" else workload_text(args.target_dir)
    ladder = LadderSettings(args.context, args.repeats, args.warmup, text)
    total = len(set(args.draft_rows)) + len(set(args.verify_batch_sizes)) * (k + 1)
    begin = time.perf_counter()
    vocab = None
    if not args.random_pair:
        vocab = resolve_draft_vocab(args.draft_dir, args.draft_vocab, draft.vocab_size)
    with tqdm(total=total, desc="profiling", unit="point") as bar:
        draft_pass = profile_draft_pass(
            draft, args.draft_rows, k, ladder, on_point=lambda *_: bar.update(),
            top_k=args.draft_top_k, draft_vocab=vocab,
        )  # fmt: skip
        verify = profile_verify_cost(
            target, k, args.verify_batch_sizes, ladder, on_point=lambda *_: bar.update()
        )
    seconds = time.perf_counter() - begin
    fit = fit_tokens_and_rows(verify.extra["shapes"])
    # at most the cheapest shape's time per row, so no shape's median nets below 0
    shapes = verify.extra["shapes"]
    row_ms = min(max(fit["per_row_ms"], 0.0), min(s["median_ms"] / s["batch"] for s in shapes))
    # The table by tokens, net of the target's per-row cost (avspec.av.step_cost).
    verify = verify_points(shapes, verify.extra.pop("samples"), row_ms)
    verify.extra.pop("samples")
    cost = StepCost(
        draft_pass.table("draft_pass"), verify.table("verify"), args.overhead_ms, row_ms
    )
    measured = {
        "command": shlex.join([*shlex.split(command), *argv]),
        "device": device_name(args.device),
        "threads": torch.get_num_threads(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "models": what,
        "max_draft_tokens": k,
        "context_length": args.context,
        "draft_vocab": "the whole vocabulary"
        if vocab is None
        else f"{vocab.path} ({len(vocab)} ids)",
        "text": "random" if text is None else f"{' + '.join(WORKLOAD_FILES)} ({len(text)} tokens)",
        "repeats": args.repeats,
        "warmup": args.warmup,
        "overhead": "--overhead-ms: the served path's per-step fixed cost, measured on a "
        "deployment by client/profile_serving_costs.py (in-process there are no hops)",
        "draft_pass": _rounded(draft_pass),
        "verify": _rounded(verify),
        "verify_by_tokens_and_rows": fit,
    }
    measured["verify_to_draft_ratio"] = {
        # None where a draft pass measured as free (no ratio to report)
        str(rows): _finite(round(cost.verify_to_draft_ratio(rows, k), 3))
        for rows in args.draft_rows
    }
    save_step_cost(args.output, cost, measured)
    print(f"{what} on {measured['device']}, {seconds:.0f} s")
    print_table(f"draft pass (one forward of `rows` tokens, from {k} vs 1 passes)", "rows",
                draft_pass, cost.draft_pass.millis)  # fmt: skip
    fixed = ", ".join(f"{r}: {f:.3f}" for r, f in zip(draft_pass.sizes,
                      draft_pass.extra["stage_fixed_ms"], strict=True))  # fmt: skip
    print(f"draft stage per-call ms besides its passes (not in the tables), by rows: {fixed}")
    print_table("verify (target stage)", "tokens", verify, cost.verify.millis)
    print(f"verify ~ {fit['fixed_ms']:.2f} + {fit['per_token_ms']:.3f} * tokens + "
          f"{fit['per_row_ms']:.3f} * rows ms (largest error over the shapes: "
          f"{fit['max_rel_error_with_rows']:.0%}; by tokens alone "
          f"{fit['max_rel_error_tokens_only']:.0%})")  # fmt: skip
    print(f"overhead_ms {cost.overhead_ms:.3f}")
    ratios = ", ".join(
        f"{r} rows: {x:.2f}" if x is not None else f"{r} rows: -"
        for r, x in measured["verify_to_draft_ratio"].items()
    )
    print(f"target ms per verified token / draft ms per row of a pass, {k} drafts a row: {ratios}")
    load_step_cost(args.output)  # what the verifier will load must load
    if args.plot is not None:
        plot_step_cost(json.loads(args.output.read_text()), args.plot)
        print(f"plotted {args.plot}")
    print(f"\nwrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
