"""The markdown model card of the default pair (models/MODEL_CARD.md), from the training log.

The log is the dict `python -m avspec.tools.training` writes to `training_log.json`: Python and
torch versions, corpus sizes, each model's `training.json` and the evaluation report
(`avspec.tools.training.evaluate.report`). Only the safetensors sizes are read from disk.
"""

from __future__ import annotations

from pathlib import Path

COMMAND = "python -m avspec.tools.training --out models --seed 0"


def model_card(out: Path, log: dict) -> str:
    """Markdown model card for the pair in `out`, from the training log."""
    rep, models = log["report"], log["models"]
    corpus = log["corpus"]
    lines = [
        "# Default draft/target pair",
        "",
        "Byte-level pre-norm GPTs with rotary positions (`avspec.runtime.transformer`), trained by",
        f"`{COMMAND}` (`make models`) on Python {log['python']}, torch {log['torch']}, "
        "CPU fp32, one torch thread. Reproducible from the seed, the step counts and the thread",
        "count on the same",
        "Python version (the corpus is that version's standard library).",
        "",
        "## Data",
        "",
        f"Top-level standard-library `.py` files plus the `pydoc_data/topics.py` topics (English,"
        f" one pseudo-file per topic), joined with EOS. Split by a hash of the file name: "
        f"{corpus['train_files']} files / {corpus['train_bytes']:,} bytes train, "
        f"{corpus['held_out_files']} files / {corpus['held_out_bytes']:,} bytes held out.",
        "",
        "## Models",
        "",
        "| model | layers | width | heads | parameters | safetensors | steps x batch x seq "
        "| train time | held-out bits/byte |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m, c, st = models[name], models[name]["config"], models[name]["settings"]
        size = (out / name / "model.safetensors").stat().st_size / 1e6
        lines.append(
            f"| {name} | {c['num_layers']} | {c['width']} | {c['num_heads']} "
            f"| {m['parameters']:,} | {size:.2f} MB | {st['steps']} x {st['batch']} x {st['seq']} "
            f"| {m['train_seconds'] / 60:.1f} min | {rep['held_out_bpb'][name]:.3f} |"
        )
    lines += [
        "",
        "Optimiser: AdamW (0.9, 0.95), weight decay 0.1, linear warmup 100 steps then cosine to",
        "10 % of the peak LR (target 2e-3, draft 3e-3), gradient clip 1.0. Train time is wall",
        "time on a shared 2-core machine.",
        "",
        "## Acceptance by draft position",
        "",
        "Mean over 200 held-out prompts (128 bytes each) of sum_v min(p(v), q(v)) at each of",
        "K = 8 positions drafted autoregressively from the draft, temperature 1, top-p 0.95",
        "(`avspec.tools.training.evaluate.acceptance_by_position`).",
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
    lines += ["", "## Samples (temperature 1, top-p 0.95, 160 bytes)", ""]
    for name, samples in rep["samples"].items():
        for kind, text in samples.items():
            lines += [f"{name}, {kind}:", "", "```", text, "```", ""]
    return "\n".join(lines)
