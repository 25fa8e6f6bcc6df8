"""Build a reduced draft vocabulary (avspec.engine.draft_vocab) from target-written text.

    python -m avspec.tools.train.draft_vocab --target models/target \\
        --chunks build/draft-smollm2/train --heldout build/draft-smollm2/heldout \\
        --size 8192 --out models/draft/draft_vocab.json

Counts token frequencies in the answers the target wrote in the draft's training chunks
(`avspec.tools.train.draft.evaluate.load_chunks`; `--prompts` counts the prompts too) and keeps the
`--size` ids that are always kept plus the most frequent others; ids counted equally often (most
of the vocabulary is never written in a few hundred answers) rank by the target's warped
probability summed over the answer positions (the chunks' saved top-64 logits: what it could
have written), then by the lower id. Always kept, whatever their count: the tokenizer's special
tokens, EOS and BOS, and every id of the target's chat template rendered with a system, a user
and an assistant turn.

Coverage, printed and written into the file (`coverage`):

- `train_answer_tokens`, `heldout_answer_tokens`: the share of answer tokens inside the map
  (in-sample for the training chunks);
- `heldout_target_mass`: the target's warped probability (temperature 0.7, top-p 0.95, from
  the chunks' saved top-64 logits) that falls inside the map, averaged over the held-out answer
  positions. A draft with the map can never propose the rest, so acceptance drops by about
  this mass's complement times the full draft's acceptance there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from avspec.engine.draft_vocab import save_draft_vocab
from avspec.engine.sampling import warp_probs
from avspec.runtime.hf_files import CONFIG_FILE
from avspec.runtime.model_dir import load_tokenizer
from avspec.serving.front.openai.chat_template import ChatTemplate
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P, load_chunks

# Turns rendered through the chat template to find its own tokens (roles, markers, newlines).
TEMPLATE_TURNS = [
    [{"role": "system", "content": ""}, {"role": "user", "content": ""},
     {"role": "assistant", "content": ""}],
    [{"role": "user", "content": ""}, {"role": "assistant", "content": ""}],
]  # fmt: skip


def vocab_width(target: Path) -> int:
    """Ids a map may hold: the target's embedding rows, within its tokenizer's ids."""
    rows = json.loads((target / CONFIG_FILE).read_text())["vocab_size"]
    return min(int(rows), load_tokenizer(target).vocab_size)


def always_kept(target: Path) -> list[int]:
    """Special tokens, EOS, BOS and the chat template's tokens of the target directory."""
    tokenizer = load_tokenizer(target)
    ids = set(tokenizer.special_ids) | set(tokenizer.eos_ids)
    if tokenizer.bos_id is not None:
        ids.add(tokenizer.bos_id)
    template = ChatTemplate.from_directory(target)
    if template is not None:
        for turns in TEMPLATE_TURNS:
            ids.update(tokenizer.encode(template.render(turns, add_generation_prompt=True)))
    return sorted(ids)


def count_tokens(sequences: Iterable[dict], width: int, prompts: bool = False) -> torch.Tensor:
    """Occurrences [width] int64 of each id in the sequences' answers (and prompts)."""
    counts = torch.zeros(width, dtype=torch.int64)
    for seq in sequences:
        parts = [seq["answer"]]
        if prompts:
            parts.append(seq["ids"][: seq["prompt_length"]])
        for ids in parts:
            ids = ids.long()
            counts += torch.bincount(ids[ids < width], minlength=width)
    return counts


def teacher_mass(sequences: Iterable[dict], width: int) -> torch.Tensor:
    """The target's warped probability [width] float64 of each id, summed over the answer
    positions (from the saved top-64 logits, as `target_mass` reads them)."""
    total = torch.zeros(width, dtype=torch.float64)
    for seq in sequences:
        top_ids, top_logits = seq["top_ids"].long(), seq["top_logits"].float()
        n = len(top_ids)
        p = warp_probs(top_logits[:, None], torch.full((n,), TEMPERATURE), torch.full((n,), TOP_P))
        inside = top_ids < width
        total.index_add_(0, top_ids[inside], p[:, 0][inside].double())
    return total


def choose(
    counts: torch.Tensor, size: int, kept: Sequence[int], mass: torch.Tensor | None = None
) -> list[int]:
    """`kept` plus the most frequent other ids (ties: the larger `mass`, then the lower id),
    `size` in all (at least `kept`), sorted."""
    chosen = set(kept)
    order = torch.arange(len(counts))
    if mass is not None:  # stable sorts: the later key decides, the earlier breaks its ties
        order = order[torch.argsort(-mass[order], stable=True)]
    order = order[torch.argsort(-counts[order], stable=True)]
    for token in order.tolist():
        if len(chosen) >= size:
            break
        chosen.add(token)
    return sorted(chosen)


def token_coverage(sequences: Iterable[dict], member: torch.Tensor) -> float:
    """Share of the sequences' answer tokens whose id is in the map (`member` [width] bool)."""
    inside = total = 0
    for seq in sequences:
        inside += int(_inside(seq["answer"].long(), member).sum())
        total += len(seq["answer"])
    return inside / max(total, 1)


def target_mass(sequences: Iterable[dict], member: torch.Tensor) -> float:
    """The target's warped mass inside the map, mean over answer positions (top-64 logits: mass
    beyond them is dropped, as the warp at top-p 0.95 almost always drops it anyway)."""
    masses = []
    for seq in sequences:
        top_ids, top_logits = seq["top_ids"].long(), seq["top_logits"].float()
        n = len(top_ids)
        p = warp_probs(top_logits[:, None], torch.full((n,), TEMPERATURE), torch.full((n,), TOP_P))
        inside = _inside(top_ids, member)
        masses.append((p[:, 0] * inside).sum(-1))
    return float(torch.cat(masses).mean()) if masses else float("nan")


def _inside(ids: torch.Tensor, member: torch.Tensor) -> torch.Tensor:
    """ids [...] -> [...] bool: in the map (an id past its width never is)."""
    width = len(member)
    return torch.where(ids < width, member[ids.clamp_max(width - 1)], False)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m avspec.tools.train.draft_vocab", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--target", type=Path, default=Path("models/target"))
    parser.add_argument("--chunks", type=Path, default=Path("build/draft-smollm2/train"))
    parser.add_argument("--heldout", type=Path, help="held-out chunks for the coverage figures")
    parser.add_argument("--size", type=int, default=8192, help="ids kept, special ones included")
    parser.add_argument("--prompts", action="store_true", help="count prompt tokens too")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def build(args: argparse.Namespace) -> dict:
    """Choose the map and measure its coverage; returns what is written besides the ids."""
    width = vocab_width(args.target)
    if not 1 <= args.size <= width:
        raise SystemExit(f"--size must lie in 1..{width} (the target's ids), got {args.size}")
    special = always_kept(args.target)
    train = load_chunks(args.chunks)
    if not train:
        raise SystemExit(f"no chunk_*.pt files in {args.chunks}")
    counts = count_tokens(train, width, args.prompts)
    ids = choose(counts, args.size, special, teacher_mass(train, width))
    member = torch.zeros(width, dtype=torch.bool)
    member[ids] = True
    coverage = {"train_answer_tokens": round(token_coverage(train, member), 4)}
    del train
    if args.heldout is not None:
        heldout = load_chunks(args.heldout)
        coverage["heldout_answer_tokens"] = round(token_coverage(heldout, member), 4)
        coverage["heldout_target_mass"] = round(target_mass(heldout, member), 4)
        coverage["heldout_positions"] = sum(len(s["answer"]) for s in heldout)
    counted = "answers and prompts" if args.prompts else "answers"
    source = (
        f"avspec.tools.train.draft_vocab: the {len(ids) - len(special)} most frequent ids of the "
        "target-"
        f"written {counted} in {args.chunks} ({int(counts.sum())} tokens; ties by the target's "
        f"top-64 mass) and {len(special)} special / chat-template ids of {args.target}"
    )
    return {"token_ids": ids, "source": source, "vocab_size": width, "always_kept": special,
            "coverage": coverage}  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    result = build(args)
    ids = result.pop("token_ids")
    save_draft_vocab(args.out, ids, **result)
    print(f"{args.out}: {len(ids)} of {result['vocab_size']} ids; coverage {result['coverage']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
