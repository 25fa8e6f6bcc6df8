"""The markdown model card of the tiny pair (models/tiny/MODEL_CARD.md), from the training log.

The tiny pair was the default before SmolLM2-135M-Instruct; it stays as a fast, fully
reproducible pair for comparisons.

The log is the dict `python -m avspec.tools.train.tiny` writes to `training_log.json`: Python and
torch versions, corpus sizes, each model's `training.json` and the evaluation report
(`avspec.tools.train.tiny.evaluate.report`). Only the safetensors sizes are read from disk.
"""

from __future__ import annotations

from pathlib import Path

COMMAND = "python -m avspec.tools.train.tiny --out models/tiny --seed 0"


def model_card(out: Path, log: dict) -> str:
    """Markdown model card for the pair in `out`, from the training log."""
    rep, corpus = log["report"], log["corpus"]
    lines = [
        "# Tiny draft/target pair (the default before SmolLM2)",
        "",
        "Two `LlamaForCausalLM` checkpoints (SwiGLU MLP, RMSNorm, rotary positions, grouped-query",
        "attention, tied embeddings) sharing one byte-level BPE tokenizer, trained by",
        f"`{COMMAND}` (`make tiny-models`) on Python {log['python']}, "
        f"torch {log['torch']}, CPU fp32.",
        "The draft is distilled from the target (KL to the target's distribution). Weights are",
        "stored in bf16; `transformers` and the served runtime load them as they are.",
        "Reproducible from the seed, the step counts and the thread count on the same Python",
        "version (the corpus is that version's standard library).",
        "",
        "## Data and tokenizer",
        "",
        "Top-level standard-library `.py` files plus the `pydoc_data/topics.py` topics (English,"
        " one pseudo-file per topic), joined with EOS. Split by a hash of the file name: "
        f"{corpus['train_files']} files / {corpus['train_bytes']:,} bytes train, "
        f"{corpus['held_out_files']} files / {corpus['held_out_bytes']:,} bytes held out.",
    ]
    if "vocab_size" in corpus:
        bytes_per_token = corpus["held_out_bytes"] / max(corpus["held_out_tokens"], 1)
        lines += [
            "",
            f"Byte-level BPE of {corpus['vocab_size']:,} pieces (`<|endoftext|>` = id 0 is EOS "
            "and BOS; no BOS is prepended) trained on the train split by "
            "`avspec.tools.train.tiny.bpe`: "
            f"{corpus['train_tokens']:,} train / {corpus['held_out_tokens']:,} held-out tokens, "
            f"{bytes_per_token:.2f} held-out bytes per token.",
        ]
    lines += _models_table(out, log)
    lines += [
        "",
        "Optimiser: AdamW (0.9, 0.95), weight decay 0.1, linear warmup 100 steps then cosine to",
        "10 % of the peak LR, gradient clip 1.0. Bits/byte: the held-out cross-entropy summed",
        "over tokens, divided by the UTF-8 bytes they spell. Train time is wall time on a shared",
        "2-core machine.",
        "",
        "## Acceptance by draft position",
        "",
        "Mean over 200 held-out prompts of sum_v min(p(v), q(v)) at each of K = 8 positions",
        "drafted autoregressively from the draft, temperature 1, top-p 0.95",
        "(`avspec.tools.train.tiny.evaluate.acceptance_by_position`).",
        "",
        "| prompts | " + " | ".join(str(k + 1) for k in range(8)) + " |",
        "|---|" + "---|" * 8,
    ]
    for kind, curve in rep["acceptance_by_position"].items():
        lines.append(f"| {kind} | " + " | ".join(f"{a:.3f}" for a in curve) + " |")
    lines += [
        "",
        "Each entry is the acceptance rate of one position given that the drafts before it were",
        "made; a draft at depth k is used only if all k - 1 before it were accepted, so the chance",
        "of reaching depth k falls roughly as the product of the entries before it.",
    ]
    lines += ["", "## Samples (temperature 1, top-p 0.95)", ""]
    for name, samples in rep["samples"].items():
        for kind, text in samples.items():
            lines += [f"{name}, {kind}:", "", "```", text, "```", ""]
    if rep.get("greedy"):
        lines += ["## Greedy continuations of the README's prompts", ""]
        for name, continuations in rep["greedy"].items():
            for text in continuations.values():
                lines += [f"{name}:", "", "```", text, "```", ""]
    return "\n".join(lines)


def _models_table(out: Path, log: dict) -> list[str]:
    rep, models = log["report"], log["models"]
    lines = [
        "",
        "## Models",
        "",
        "| model | layers | width | heads (kv) | MLP | parameters | safetensors "
        "| steps x batch x seq | train time | held-out bits/byte |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m, c, st = models[name], models[name]["config"], models[name]["settings"]
        size = (out / name / "model.safetensors").stat().st_size / 1e6
        heads = f"{c['num_heads']} ({c.get('num_kv_heads', c['num_heads'])})"
        mlp = f"{c.get('mlp', 'gelu')} {c.get('intermediate_size', 4 * c['width'])}"
        lines.append(
            f"| {name} | {c['num_layers']} | {c['width']} | {heads} | {mlp} "
            f"| {m['parameters']:,} | {size:.2f} MB | {st['steps']} x {st['batch']} x {st['seq']} "
            f"| {m['train_seconds'] / 60:.1f} min | {rep['held_out_bpb'][name]:.3f} |"
        )
    return lines
