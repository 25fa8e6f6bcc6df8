"""Train the default draft/target pair on the Python standard library and its pydoc topics.

Corpus: the running Python's top-level standard-library `.py` files (code) plus the topics of
`pydoc_data/topics.py` (English prose, one pseudo-file per topic). Files are split into train
and held-out by a hash of their name (about 10 % held out), then joined with EOS. Training is
reproducible from `--seed` and the step counts (not wall time) on a given Python version.

    python -m avspec.tools.training --out models --seed 0

writes `models/target`, `models/draft` (see `avspec.runtime.model_dir`) and
`models/training_log.json` with held-out bits/byte, the acceptance curve by draft position and
samples.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from pydoc_data.topics import topics as pydoc_topics

import torch
import torch.nn.functional as F
from tqdm import tqdm

from avspec.engine.sampling import warp_probs
from avspec.runtime.model_dir import load_model_dir, save_model_dir
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights

TOPICS_PREFIX = "pydoc_data/topics.py:"
HELD_OUT_BUCKETS = 10  # one bucket of ten is held out

TARGET_CONFIG = TransformerConfig(num_layers=4, width=256, num_heads=4)
DRAFT_CONFIG = TransformerConfig(num_layers=1, width=96, num_heads=2)


@dataclass(frozen=True)
class TrainSettings:
    """Optimisation settings of one model; `steps` fixes the run (never wall time)."""

    steps: int
    batch: int = 16
    seq: int = 256
    lr: float = 2e-3
    warmup: int = 100
    weight_decay: float = 0.1


def corpus_files() -> list[tuple[str, str]]:
    """(name, text) of every corpus file, sorted by name: stdlib modules then pydoc topics."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in stdlib.glob("*.py")]
    files += [(TOPICS_PREFIX + key, text) for key, text in pydoc_topics.items()]
    return sorted(files)


def is_held_out(name: str) -> bool:
    """Deterministic split by file name: sha256 bucket 0 of HELD_OUT_BUCKETS is held out."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % HELD_OUT_BUCKETS == 0


def split_files(files: Sequence[tuple[str, str]]) -> tuple[list, list]:
    """Split (name, text) files into (train, held_out); both must contain code and prose."""
    train = [f for f in files if not is_held_out(f[0])]
    held_out = [f for f in files if is_held_out(f[0])]
    for part, label in ((train, "train"), (held_out, "held-out")):
        kinds = {name.startswith(TOPICS_PREFIX) for name, _ in part}
        if kinds != {True, False}:
            raise ValueError(f"the {label} split lacks code or prose: {len(part)} files")
    return train, held_out


def encode_files(files: Sequence[tuple[str, str]], tokenizer: ByteTokenizer) -> torch.Tensor:
    """Join files with EOS into one token stream [tokens] int64."""
    ids: list[int] = []
    for _, text in files:
        ids += tokenizer.encode(text)
        ids.append(tokenizer.eos_id)
    return torch.tensor(ids, dtype=torch.int64)


def lr_at(step: int, settings: TrainSettings) -> float:
    """Linear warmup then cosine decay to 10 % of the peak."""
    if step < settings.warmup:
        return settings.lr * (step + 1) / settings.warmup
    progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
    return settings.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * progress)))


def train_model(
    config: TransformerConfig,
    settings: TrainSettings,
    train_ids: torch.Tensor,
    eval_ids: torch.Tensor,
    seed: int,
    label: str,
) -> tuple[Transformer, list[dict]]:
    """Train from scratch on random windows of `train_ids` [tokens]; return model and log."""
    init_gen = torch.Generator().manual_seed(seed)
    data_gen = torch.Generator().manual_seed(seed + 1)
    model = Transformer(config)
    init_weights(model, init_gen)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=settings.weight_decay
    )
    log = []
    bar = tqdm(range(settings.steps), desc=label, mininterval=10.0, file=sys.stderr)
    for step in bar:
        starts = torch.randint(
            0, len(train_ids) - settings.seq - 1, (settings.batch,), generator=data_gen
        )
        window = torch.stack([train_ids[s : s + settings.seq + 1] for s in starts.tolist()])
        # window: (batch, seq + 1); inputs are the first seq, targets the last seq
        logits = model(window[:, :-1])  # (batch, seq, vocab)
        loss = F.cross_entropy(logits.flatten(0, 1), window[:, 1:].flatten())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, settings)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        bar.set_postfix(bits_per_byte=f"{loss.item() / math.log(2):.3f}", refresh=False)
        if (step + 1) % 250 == 0 or step + 1 == settings.steps:
            held_out = bits_per_byte(model, eval_ids, settings.seq, max_windows=32)
            log.append(
                {"step": step + 1, "train_bpb": loss.item() / math.log(2), "held_out_bpb": held_out}
            )
            tqdm.write(
                f"{label} step {step + 1}: held-out {held_out:.3f} bits/byte", file=sys.stderr
            )
    return model.eval(), log


@torch.no_grad()
def bits_per_byte(model: Transformer, ids: torch.Tensor, seq: int, max_windows: int = 256) -> float:
    """Mean next-token loss in bits over evenly spaced non-overlapping windows of ids [tokens]."""
    count = min(max_windows, (len(ids) - 1) // seq)
    stride = (len(ids) - 1) // count
    windows = torch.stack([ids[i * stride : i * stride + seq + 1] for i in range(count)])
    total = 0.0
    for chunk in windows.split(32):  # (rows, seq + 1)
        logits = model(chunk[:, :-1])
        total += F.cross_entropy(
            logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="sum"
        ).item()
    return total / (count * seq) / math.log(2)


def warp(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """`avspec.engine.sampling.warp_probs`, one setting for all rows.

    logits: [batch, (position,) vocab].
    """
    rows = logits if logits.dim() == 3 else logits[:, None]  # [batch, position, vocab]
    n = rows.shape[0]
    settings = {"device": logits.device, "dtype": torch.float32}
    probs = warp_probs(
        rows.float(), torch.full((n,), temperature, **settings), torch.full((n,), top_p, **settings)
    )
    return probs if logits.dim() == 3 else probs[:, 0]


@torch.no_grad()
def acceptance_by_position(
    draft: Transformer,
    target: Transformer,
    prompts: torch.Tensor,
    num_positions: int = 8,
    temperature: float = 1.0,
    top_p: float = 0.95,
    generator: torch.Generator | None = None,
) -> list[float]:
    """Mean over prompts of sum_v min(p(v), q(v)) at each draft position.

    prompts: [batch, seq] int64 (equal-length prompts). The draft samples `num_positions` tokens
    autoregressively from its warped distribution q; the target's warped p is taken at the same
    contexts. Returns one mean per position (position 0 first).
    """
    context = prompts
    draft_probs = []
    for _ in range(num_positions):
        q = warp(draft(context)[:, -1], temperature, top_p)  # (batch, vocab)
        token = torch.multinomial(q, 1, generator=generator)  # (batch, 1)
        draft_probs.append(q)
        context = torch.cat([context, token], dim=1)
    target_logits = target(context[:, :-1])[:, prompts.shape[1] - 1 :]  # (batch, position, vocab)
    p = warp(target_logits, temperature, top_p)
    q = torch.stack(draft_probs, dim=1)  # (batch, position, vocab)
    return torch.minimum(p, q).sum(-1).mean(0).tolist()


def heldout_prompts(
    files: Sequence[tuple[str, str]], count: int, length: int, prose: bool
) -> torch.Tensor:
    """`count` prompts [count, length] of held-out code (prose=False) or prose, evenly spaced."""
    chosen = [f for f in files if f[0].startswith(TOPICS_PREFIX) == prose]
    ids = encode_files(chosen, ByteTokenizer())
    stride = (len(ids) - length) // count
    return torch.stack([ids[i * stride : i * stride + length] for i in range(count)])


@torch.no_grad()
def sample(model: Transformer, prompt: str, num_bytes: int, generator: torch.Generator) -> str:
    """Sample `num_bytes` continuation bytes at temperature 1, top-p 0.95 (full recompute)."""
    tokenizer = ByteTokenizer()
    ids = torch.tensor([tokenizer.encode(prompt)])
    for _ in range(num_bytes):
        probs = warp(model(ids[:, -model.config.max_length :])[:, -1], 1.0, 0.95)
        token = torch.multinomial(probs, 1, generator=generator)
        if int(token) == tokenizer.eos_id:
            break
        ids = torch.cat([ids, token], dim=1)
    return tokenizer.decode(ids[0].tolist())


COMMAND = "python -m avspec.tools.training --out models --seed 0"
SAMPLE_PROMPTS = {"python": "def parse_args(argv):\n", "english": "The with statement is used to "}


def report(draft: Transformer, target: Transformer, held_out: list, seed: int) -> dict:
    """Held-out bits/byte, acceptance curves (code, prose) and samples of both models."""
    held_out_ids = encode_files(held_out, ByteTokenizer())
    result = {
        "held_out_bpb": {
            "target": bits_per_byte(target, held_out_ids, 256),
            "draft": bits_per_byte(draft, held_out_ids, 256),
        },
        "acceptance_by_position": {},
        "samples": {},
    }
    for kind, prose in (("code", False), ("prose", True)):
        prompts = heldout_prompts(held_out, 200, 128, prose)
        gen = torch.Generator().manual_seed(seed)
        result["acceptance_by_position"][kind] = acceptance_by_position(
            draft, target, prompts, generator=gen
        )
    for name, model in (("target", target), ("draft", draft)):
        gen = torch.Generator().manual_seed(seed)
        result["samples"][name] = {k: sample(model, p, 160, gen) for k, p in SAMPLE_PROMPTS.items()}
    return result


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
        "(`avspec.tools.training.acceptance_by_position`).",
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


def train_and_save(name: str, args: argparse.Namespace, corpus: dict) -> None:
    """Train one model of the pair and write `out/<name>` plus its `training.json` log."""
    config, settings, seed = {
        "draft": (DRAFT_CONFIG, TrainSettings(args.draft_steps, lr=3e-3), args.seed + 100),
        "target": (TARGET_CONFIG, TrainSettings(args.target_steps), args.seed),
    }[name]
    start = time.perf_counter()
    model, curve = train_model(
        config, settings, corpus["train_ids"], corpus["held_out_ids"], seed, name
    )
    save_model_dir(args.out / name, model, ByteTokenizer())
    log = {
        "config": config.to_dict(),
        "settings": asdict(settings),
        "seed": seed,
        "threads": args.threads,
        "parameters": model.num_parameters(),
        "train_seconds": time.perf_counter() - start,
        "curve": curve,
    }
    (args.out / name / "training.json").write_text(json.dumps(log, indent=2) + "\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models"), help="output directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--target-steps", type=int, default=800)
    parser.add_argument("--draft-steps", type=int, default=1500)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch intra-op threads (1: robust when shared)"
    )
    parser.add_argument(
        "--only",
        choices=("draft", "target", "report"),
        help="run one phase (train draft, train target, or report on both saved models)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokenizer = ByteTokenizer()
    train, held_out = split_files(corpus_files())
    corpus = {
        "train_ids": encode_files(train, tokenizer),
        "held_out_ids": encode_files(held_out, tokenizer),
    }
    for name in ("draft", "target"):
        if args.only in (None, name):
            train_and_save(name, args, corpus)
    if args.only not in (None, "report"):
        return
    draft, _ = load_model_dir(args.out / "draft")
    target, _ = load_model_dir(args.out / "target")
    log = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "corpus": {
            "train_files": len(train),
            "held_out_files": len(held_out),
            "train_bytes": len(corpus["train_ids"]),
            "held_out_bytes": len(corpus["held_out_ids"]),
        },
        "models": {
            name: json.loads((args.out / name / "training.json").read_text())
            for name in ("draft", "target")
        },
        "report": report(draft, target, held_out, args.seed),
    }
    (args.out / "training_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (args.out / "MODEL_CARD.md").write_text(model_card(args.out, log))
    print(json.dumps(log["report"], indent=2))


if __name__ == "__main__":
    main()
