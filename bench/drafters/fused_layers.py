"""Does EAGLE-3's fusion of a low, a middle and a high layer pay for this head? An A/B.

    .venv/bin/python bench/drafters/fused_layers.py features          # ~10 min, one thread
    .venv/bin/python bench/drafters/fused_layers.py train --arm eagle1 --minutes 25 &
    .venv/bin/python bench/drafters/fused_layers.py train --arm fused --minutes 25
    .venv/bin/python bench/drafters/fused_layers.py train --arm no-ttt --minutes 12 --tag -12 &
    .venv/bin/python bench/drafters/fused_layers.py train --arm eagle1 --minutes 12 --tag -12
    .venv/bin/python bench/drafters/fused_layers.py report > bench/drafters/fused_layers.txt

`features`: for the TRAIN_CHUNKS chunks of build/drafter-data/train (all) and the held-out sets,
the target (bf16) runs teacher-forced over each sequence's ids, and the residual stream after
block LOW and after block MID is kept, RMS-normalised without a gain (float16, build/fused-data).
The high feature is the one the chunks already hold (the final norm's output).

`train`: both arms start from the committed head (models/head) and train the same minutes on
the same sequences with the same schedule (`avspec.tools.train.head.train.head_loss`: depth-3
training-time test, the top-64 KL over the kept ids plus the feature regression; lr 3e-4, warmup
then cosine). `eagle1` feeds the head the high feature, as served today; `fused` feeds it
W [low ; mid ; high], W a 3 x width -> width linear started as the identity on the high third,
so both arms start as the same head and differ only by what the fusion learns. At depth 2 and
deeper both feed back the head's own guess (as EAGLE-3 does).

`no-ttt` is `eagle1` trained at depth 1 only, without the training-time test: what the
test buys at depths 2-3.

`report`: teacher-forced acceptance at depths 1-3 and AUC of logit(q_max) on the held-out sets
(`avspec.tools.train.head.evaluate.head_outcomes`), both arms and the starting head.
"""

from __future__ import annotations

import argparse
import platform
import random
import subprocess
import time
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.head import load_head
from avspec.runtime.model_dir import load_model
from avspec.tools.train.draft.evaluate import chunk_sequences, logit, soft_auc
from avspec.tools.train.draft.train import batches, kept_slots, lr_at
from avspec.tools.train.head.batch import PROMPT_CONTEXT, head_batch, trimmed
from avspec.tools.train.head.evaluate import head_outcomes
from avspec.tools.train.head.train import head_loss

ROOT = Path(__file__).resolve().parents[2]
DATA, OUT = ROOT / "build/drafter-data", ROOT / "build/fused-data"
LOW, MID = 2, 14  # blocks of the 30-layer target whose outputs are fused with the last
TRAIN_CHUNKS = 6  # all of them
HELDOUT = ("heldout", "heldout_general")
LR, TOKENS_PER_BATCH, DEPTH, FEATURE_WEIGHT = 3e-4, 2048, 3, 0.1
ARMS = ("eagle1", "fused", "no-ttt")  # no-ttt: eagle1 trained at depth 1 (no training-time test)


def rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(x.dtype)


@torch.no_grad()
def write_features() -> None:
    """build/fused-data/<set>/chunk_*.pt: `low` and `mid` [len(ids), width] per sequence."""
    torch.set_num_threads(1)
    target = load_model(ROOT / "models/target", dtype=torch.bfloat16, max_length=1024)
    sets = {"train": sorted((DATA / "train").glob("chunk_*.pt"))[:TRAIN_CHUNKS]}
    sets |= {name: sorted((DATA / name).glob("chunk_*.pt")) for name in HELDOUT}
    for name, paths in sets.items():
        (OUT / name).mkdir(parents=True, exist_ok=True)
        for path in paths:
            if (OUT / name / path.name).is_file():
                continue
            chunk = torch.load(path, weights_only=True)
            low, mid = [], []
            for prompt, answer in tqdm(list(zip(chunk["prompt"], chunk["answer"], strict=True)),
                                       desc=f"{name}/{path.name}"):  # fmt: skip
                ids = torch.cat([prompt, answer[:-1]]).long()[None]
                x = target.embed(ids)
                for i, block in enumerate(target.blocks[: MID + 1]):
                    x = block(x, target.rotary)
                    if i == LOW:
                        low.append(rms(x[0]).half())
                mid.append(rms(x[0]).half())
            torch.save({"low": low, "mid": mid}, OUT / name / path.name)


def load_set(name: str) -> list[dict]:
    """The set's sequences (only the chunks with fused features), each with its `low` and
    `mid` beside `features`."""
    sequences: list[dict] = []
    for path in sorted((OUT / name).glob("chunk_*.pt")):
        extra = torch.load(path, weights_only=True)
        rows = chunk_sequences(torch.load(DATA / name / path.name, weights_only=True))
        for row, low, mid in zip(rows, extra["low"], extra["mid"], strict=True):
            sequences.append(row | {"low": low, "mid": mid})
    return sequences


class Fuse(nn.Module):
    """W [low ; mid ; high]: 3 x width -> width, started as the identity on the high third."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(3 * width, width, bias=False)
        with torch.no_grad():
            self.linear.weight.zero_()
            self.linear.weight[:, 2 * width :].copy_(torch.eye(width))

    def forward(self, low: torch.Tensor, mid: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([low, mid, high], dim=-1))


def dense(sequences: list[dict], key: str, length: int) -> torch.Tensor:
    """[batch, length, width] of each (trimmed) sequence's `key`, zero-padded."""
    width = sequences[0][key].shape[-1]
    out = torch.zeros(len(sequences), length, width)
    for r, s in enumerate(sequences):
        out[r, : len(s[key])] = s[key].float()
    return out


def trimmed_all(sequence: dict) -> dict:
    """`batch.trimmed` applied to low and mid too (they share the ids' positions)."""
    cut = max(0, sequence["prompt_length"] - PROMPT_CONTEXT)
    return trimmed(sequence) | {"low": sequence["low"][cut:], "mid": sequence["mid"][cut:]}


def fused_inputs(fuse: Fuse, sequences: list[dict], length: int) -> torch.Tensor:
    rows = [trimmed_all(s) for s in sequences]
    return fuse(dense(rows, "low", length), dense(rows, "mid", length),
                dense(rows, "features", length))  # fmt: skip


def arm_path(arm: str) -> Path:
    return OUT / f"{arm}.pt"


def saved_arms() -> list[str]:
    """The arms trained so far (`<arm>.pt`, or `<arm>-<minutes>.pt` for a shorter run)."""
    return sorted(p.stem for p in OUT.glob("*.pt"))


def train(arm: str, minutes: float, tag: str = "") -> None:
    torch.set_num_threads(1)
    target = load_model(ROOT / "models/target", max_length=1024)
    vocab = load_draft_vocab(ROOT / "models/head/draft_vocab.json", target.config.vocab_size)
    kept = torch.tensor(vocab.token_ids)
    slots = kept_slots(kept, target.config.vocab_size)
    head, _ = load_head(ROOT / "models/head", target)
    head.train()
    fuse = Fuse(target.config.width) if arm == "fused" else None
    params = [p for p in head.parameters() if p.requires_grad]
    params += [] if fuse is None else list(fuse.parameters())
    optimizer = torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=0.0)
    sequences = load_set("train")
    rng, elapsed, budget, step = random.Random(0), 0.0, minutes * 60, 0
    bar = tqdm(total=int(budget), desc=f"{arm} (s)", mininterval=10.0)
    while elapsed < budget:
        for group in batches(sequences, TOKENS_PER_BATCH, rng):
            tick = time.perf_counter()
            for g in optimizer.param_groups:
                g["lr"] = lr_at(elapsed / budget, LR)
            batch = head_batch(group)
            inputs = None if fuse is None else fused_inputs(fuse, group, batch.features.shape[1])
            depth = 1 if arm == "no-ttt" else DEPTH
            loss, _ = head_loss(head, batch, depth, kept, slots, FEATURE_WEIGHT, inputs)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            elapsed += time.perf_counter() - tick
            step += 1
            bar.update(int(elapsed) - bar.n)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if elapsed >= budget:
                break
    bar.close()
    state = {k: v for k, v in head.state_dict().items() if k != "layers.embed.weight"}
    torch.save({"head": state, "fuse": None if fuse is None else fuse.state_dict(),
                "steps": step, "minutes": minutes}, arm_path(arm + tag))  # fmt: skip


@torch.no_grad()
def report() -> None:
    torch.set_num_threads(2)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    print(f"# host: {platform.processor() or 'cpu'}; flags: {[f for f in wanted if f in flags]}")
    print(f"# low = block {LOW}, mid = block {MID}, high = final norm; train: the first "
          f"{TRAIN_CHUNKS} chunks of build/drafter-data/train")  # fmt: skip
    target = load_model(ROOT / "models/target", max_length=1024)
    kept = torch.tensor(load_draft_vocab(ROOT / "models/head/draft_vocab.json", 49152).token_ids)
    arms: dict[str, dict | None] = {"start (models/head)": None}
    arms |= {arm: torch.load(arm_path(arm)) for arm in saved_arms()}
    for name in HELDOUT:
        sequences = load_set(name)
        print(f"\n{name}: {len(sequences)} sequences")
        print(f"{'arm':<22} {'steps':>6} {'acceptance d1/d2/d3':>22} {'AUC d1/d2/d3':>22}")
        for arm, saved in arms.items():
            head, _ = load_head(ROOT / "models/head", target)
            rows = sequences
            if saved is not None:
                head.load_state_dict(saved["head"] | {"layers.embed.weight": target.embed.weight})
                if saved["fuse"] is not None:
                    fuse = Fuse(target.config.width)
                    fuse.load_state_dict(saved["fuse"])
                    rows = [s | {"features": fuse(s["low"].float(), s["mid"].float(),
                                                  s["features"].float())}
                            for s in sequences]  # fmt: skip
            outcomes = head_outcomes(head.eval(), rows, kept, depth=DEPTH)
            acc = "/".join(f"{float(a.mean()):.3f}" for a, _ in outcomes)
            auc = "/".join(f"{soft_auc(logit(q), a):.3f}" for a, q in outcomes)
            steps = "-" if saved is None else saved["steps"]
            print(f"{arm:<22} {steps:>6} {acc:>22} {auc:>22}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("features", "train", "report"))
    parser.add_argument("--arm", choices=ARMS)
    parser.add_argument("--minutes", type=float, default=25.0)
    parser.add_argument("--tag", default="", help="saved as <arm><tag>.pt (e.g. -12)")
    args = parser.parse_args()
    if args.phase == "features":
        write_features()
    elif args.phase == "train":
        train(args.arm, args.minutes, args.tag)
    else:
        report()


if __name__ == "__main__":
    main()
