"""Reduced draft vocabulary on the real pair: draft pass time and acceptance, full against maps.

    python client/bench_draft_vocab.py --maps build/draft_vocab/8192.json \\
        build/draft_vocab/16384.json --json bench/draft_vocab.json

Pass time: one `DraftStage` per variant (the whole vocabulary, then each map) on the same served
draft (`--dtype`, default the server's `auto`), each row given `--context` cached tokens of a
held-out chat sequence; a pass is timed as in the cost tables (`avspec.tools.bench.profiler`): per
repeat a 1-draft call and a K-draft call from the same cached context, pass = (t_K - t_1) /
(K - 1). The variants are timed round-robin (`interleaved_ms`), so load from elsewhere lands on
all of them alike; ratios are of medians. Components at the same rows: the output layer alone
(`final_norm` and the matrix product, or the kept rows and the scatter to full width) and the
warp + sample + feature of one pass over the full-width logits; for a map also the same warp +
sample + feature over the kept ids' logits alone (what the stage does since the warp moved into
the map's own index space; the full-width figure is what it did before).

Acceptance at position 1: at every answer position of the first `--contexts` held-out sequences
(`load_chunks`: prompts of the held-out split answered by the target), sum_v min(p(v), q(v)) with
p the target's and q the draft's distribution, both warped at temperature 0.7, top-p 0.95
(float32 models); the reduced q is the warp of the draft's logits with -inf outside the map
(what the stage computes). Also the target's warped mass outside the map at those positions.
`--chat N`: the same on the first N prompts of workloads/chat.jsonl answered here by the target
(128 tokens, seed 0).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from avspec.av.features import logit_qmax
from avspec.engine.draft_stage import DraftStage
from avspec.engine.draft_vocab import DraftVocab, ReducedHead, load_draft_vocab
from avspec.engine.sampling import draft_warp, sample
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.precision import load_served_model, resolve_precision
from avspec.tools.bench.profiler import interleaved_ms, step_inputs
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P, load_chunks
from avspec.tools.train.draft.generate import answer_all
from avspec.tools.train.tiny.evaluate import warp

K = 8


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target-dir", type=Path, default=Path("models/target"))
    parser.add_argument("--draft-dir", type=Path, default=Path("models/draft"))
    parser.add_argument("--maps", type=Path, nargs="+", required=True, help="draft_vocab files")
    parser.add_argument("--heldout", type=Path, default=Path("build/draft-smollm2/heldout"))
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--context", type=int, default=128, help="cached tokens per row")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--contexts", type=int, default=64, help="held-out sequences")
    parser.add_argument("--chat", type=int, default=0, help="workloads/chat.jsonl prompts")
    parser.add_argument("--dtype", default="auto", help="the draft's serving precision")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--skip-acceptance", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    return parser.parse_args(argv)


def contexts(heldout: list[dict], rows: int, length: int) -> torch.Tensor:
    """[rows, length + 1] token ids: held-out sequences cut to length + 1 (cycled)."""
    usable = [s["ids"] for s in heldout if len(s["ids"]) > length]
    return torch.stack([usable[i % len(usable)][: length + 1] for i in range(rows)])


def time_passes(args: argparse.Namespace, variants: dict, heldout: list[dict]) -> dict:
    """Median pass ms by variant and rows (see the module doc), and the components."""
    draft = load_served_model(args.draft_dir, "cpu", args.dtype, max_length=args.context + K + 4)
    ladder = sorted(set(args.rows))
    calls, keys = [], []
    for name, vocab in variants.items():
        stage = DraftStage(draft, draft.new_cache(sum(ladder), args.context + K + 2), K,
                           check_values=False, draft_vocab=vocab)  # fmt: skip
        first = 1
        for rows in ladder:
            ids = contexts(heldout, rows, args.context)
            stage(step_inputs(ids[:, :-1], 0, K, first, TEMPERATURE, TOP_P))  # prefill: cached
            inputs = step_inputs(ids[:, -1:], args.context, K, first, TEMPERATURE, TOP_P)
            short = replace(inputs, num_draft_tokens=torch.ones_like(inputs.num_draft_tokens))
            calls.append((partial(stage, short), partial(stage, inputs)))
            keys.append((name, rows))
            first += rows
    timed = interleaved_ms(calls, args.repeats, args.warmup, "cpu")
    passes: dict[str, dict[int, float]] = {name: {} for name in variants}
    for (name, rows), (one, many) in zip(keys, timed, strict=True):
        samples = [(b - a) / (K - 1) for a, b in zip(one, many, strict=True)]
        passes[name][rows] = statistics.median(samples)
    parts = components(args, draft, variants, ladder, heldout)
    return {"pass_ms": passes, "components": parts}


def last_hidden(draft, ids: torch.Tensor) -> torch.Tensor:
    """The last block's output [rows, width] at the last token of each row of ids [rows, n]."""
    x = draft.embed(ids)
    for block in draft.blocks:
        x = block(x, draft.rotary)
    return x[:, -1]


def components(
    args: argparse.Namespace, draft, variants: dict, ladder: list[int], heldout: list[dict]
) -> dict:
    """Median ms of the output layer alone and of warp + sample + feature, by variant and rows,
    at the hidden states of real contexts."""
    calls, keys = [], []
    hidden = {rows: last_hidden(draft, contexts(heldout, rows, args.context)) for rows in ladder}
    for name, vocab in variants.items():
        head = draft.logits if vocab is None else ReducedHead(draft, vocab)
        for rows in ladder:
            x = hidden[rows]
            logits = head(x)
            temp, top_p = torch.full((rows,), TEMPERATURE), torch.full((rows,), TOP_P)
            gens = [torch.Generator().manual_seed(i) for i in range(rows)]

            def rest(logits=logits, temp=temp, top_p=top_p, gens=gens) -> None:
                z = logits[:, None].clone()
                q = draft_warp(z, temp, top_p, 0, check_values=False)[:, 0]
                sample(q, gens, check_values=False)
                logit_qmax(z, temp, check_values=False)

            group = [partial(head, x), rest]
            if vocab is not None:  # the same work on the kept ids' logits alone (not served)
                group.append(partial(rest, logits=head.kept_logits(x)))
            calls.append(tuple(group))
            keys.append((name, rows))
    timed = interleaved_ms(calls, args.repeats, args.warmup, "cpu")
    names = ("output_layer_ms", "warp_sample_feature_ms", "warp_sample_feature_kept_width_ms")
    out: dict[str, dict[str, dict[int, float]]] = {
        name: {part: {} for part in names} for name in variants
    }
    for (name, rows), samples in zip(keys, timed, strict=True):
        for part, ms in zip(names, samples, strict=False):
            out[name][part][rows] = statistics.median(ms)
    return out


@torch.no_grad()
def acceptance(draft, target, sequences: list[dict], variants: dict) -> dict:
    """Mean sum_v min(p, q) at every answer position, by variant; the target's mass outside."""
    width = target.config.vocab_size
    sums = dict.fromkeys(variants, 0.0)
    outside = {name: 0.0 for name, v in variants.items() if v is not None}
    members = {}
    for name, vocab in variants.items():
        if vocab is not None:
            member = torch.zeros(width, dtype=torch.bool)
            member[list(vocab.token_ids)] = True
            members[name] = member
    positions = 0
    for seq in sequences:
        start, n = seq["prompt_length"] - 1, seq["answer_length"]
        p = warp(target(seq["ids"][None])[0, start : start + n].float(), TEMPERATURE, TOP_P)
        logits = draft(seq["ids"][None])[0, start : start + n].float()
        for name in variants:
            if name in members:
                masked = logits.masked_fill(~members[name], float("-inf"))
                q = warp(masked, TEMPERATURE, TOP_P)
                outside[name] += float((p * ~members[name]).sum())
            else:
                q = warp(logits, TEMPERATURE, TOP_P)
            sums[name] += float(torch.minimum(p, q).sum())
        positions += n
    return {
        "positions": positions,
        "sequences": len(sequences),
        "acceptance_1": {name: s / positions for name, s in sums.items()},
        "target_mass_outside": {name: s / positions for name, s in outside.items()},
    }


def chat_sequences(target, target_dir: Path, count: int) -> list[dict]:
    """The first `count` prompts of workloads/chat.jsonl answered by the target (128 tokens)."""
    tokenizer = load_tokenizer(target_dir)
    lines = Path("workloads/chat.jsonl").read_text().splitlines()[:count]
    prompts = [tokenizer.encode(json.loads(line)["prompt"]) for line in lines]
    answers = answer_all(
        target, prompts, tokenizer.eos_ids, batch=min(64, len(prompts)), max_new_tokens=128,
        temperature=TEMPERATURE, top_p=TOP_P, keep=1, generator=torch.Generator().manual_seed(0),
    )  # fmt: skip
    sequences = []
    for prompt, answer in zip(prompts, answers, strict=True):
        tokens = answer["answer"].long()
        sequences.append({"ids": torch.cat([torch.tensor(prompt), tokens[:-1]]),
                          "prompt_length": len(prompt), "answer_length": len(tokens)})  # fmt: skip
    return sequences


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    begin = time.perf_counter()
    width = json.loads((args.draft_dir / "config.json").read_text())["vocab_size"]
    variants: dict[str, DraftVocab | None] = {"full": None}
    for path in args.maps:
        vocab = load_draft_vocab(path, width)
        variants[str(len(vocab))] = vocab
    heldout = load_chunks(args.heldout)
    result: dict = {
        "command": "python client/bench_draft_vocab.py " + " ".join(argv),
        "machine": platform.processor() or platform.machine(),
        "threads": args.threads,
        "draft_precision": str(resolve_precision(args.dtype, "cpu")),
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "maps": {name: v.path for name, v in variants.items() if v is not None},
    }
    if not args.skip_timing:
        result["timing"] = time_passes(args, variants, heldout)
        for name, by_rows in result["timing"]["pass_ms"].items():
            line = ", ".join(
                f"{rows} rows {ms:.3f} ms ({ms / result['timing']['pass_ms']['full'][rows]:.3f}x)"
                for rows, ms in by_rows.items()
            )
            print(f"pass {name}: {line}")
        for name, parts in result["timing"]["components"].items():
            print(f"components {name}: {parts}")
    if not args.skip_acceptance:
        draft = load_model(args.draft_dir, "cpu", torch.float32)
        target = load_model(args.target_dir, "cpu", torch.float32)
        result["heldout"] = acceptance(draft, target, heldout[: args.contexts], variants)
        print(f"held-out: {result['heldout']}")
        if args.chat:
            chats = chat_sequences(target, args.target_dir, args.chat)
            result["chat"] = acceptance(draft, target, chats, variants)
            print(f"chat.jsonl: {result['chat']}")
    result["seconds"] = round(time.perf_counter() - begin, 1)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
