"""The Markdown model card of a (target, draft) pair of Hugging Face directories, measured here.

    python -m avspec.tools.train.draft --only card --target models/target \\
        --out models/draft --card models/MODEL_CARD.md

Both models run in bf16 on the project's runtime (`avspec.runtime`), at the served sampling
setting (temperature 0.7, top-p 0.95). Sections:

- the pair: each model's source (a target converted from a GGUF names it, and whether it is the
  pinned one), shape, parameters, weights; the draft's training summary from its
  `training_report.json` when the directory holds one;
- acceptance by draft position 1..DEPTH: `contexts` chat prompts of the held-out split
  (`prompts.build_prompts`, seed `seed`) in the target's chat template (`generate.render`),
  answered by the target (`generate.answer_all`, up to ANSWER_TOKENS tokens); each context is
  a prompt plus a uniformly drawn share of its answer, from which the draft drafts DEPTH tokens
  autoregressively (`evaluate.draft_chains`). The entry at position k is the mean over contexts
  of sum_v min(p(v), q(v)), with its standard error over contexts;
- calibration: the AUC of logit(q_max) against acceptance, soft (expected over outcomes, no
  sampling noise) and against sampled verification labels; the served estimator's model
  (sigmoid(w f + b_k), f the served feature, `avspec.tools.train.features_zoo.fit_logistic`) fitted
  on the labels of the even contexts, and its reliability table and ECE on the odd ones;
- cost ratio: a target step against a draft pass over the same rows, from a cost-tables file
  (`avspec.av.cost_file`), only when the file was measured on this pair;
- greedy answers of both models to a few chat prompts.

The card starts with the command that regenerates it (`card_command`).
"""

from __future__ import annotations

import hashlib
import json
import math
import platform
import re
import shlex
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avspec.av.calibration import auc, ece
from avspec.av.cost_file import load_step_cost
from avspec.engine.draft_vocab import DRAFT_VOCAB_AUTO, resolve_draft_vocab
from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.hf_files import SHARED_EMBEDDING_FILE
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.evaluate import (
    TEMPERATURE,
    TOP_P,
    DraftChains,
    draft_chains,
    logit,
    served_draft,
    soft_auc,
)
from avspec.tools.train.draft.generate import MAX_PROMPT_TOKENS, answer_all, chat_renderer, render
from avspec.tools.train.draft.prompts import ChatPrompt, build_prompts
from avspec.tools.train.draft_embedding import LAYERS_FILE
from avspec.tools.train.features_zoo import fit_logistic, label_matrix, predict_logistic
from avspec.tools.train.tiny.corpus import corpus_files, split_files

DEPTH = 8
CONTEXTS = 256
ANSWER_TOKENS = 64  # target answer tokens per prompt; contexts end inside them
BINS = 10
NOISE_DRAWS = 200
COST_ROWS = (1, 64)
DTYPE = torch.bfloat16
SAMPLE_TOKENS = 48
SAMPLE_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "What does HTTP stand for?",
    "Explain what a Python list comprehension is in one sentence.",
)
ACCEPTANCE_HEADER = "| position | acceptance | s.e. | contexts |"


def card_command(
    target: Path | str,
    draft: Path | str,
    card: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    threads: int = 1,
    cost_tables: Path | str | None = None,
) -> str:
    """The shell command that regenerates a card (`python -m avspec.tools.train.draft
    --only card`)."""
    parts = ["python", "-m", "avspec.tools.train.draft", "--only", "card", "--target", str(target)]
    parts += ["--out", str(draft), "--card", str(card), "--card-contexts", str(contexts)]
    parts += ["--seed", str(seed), "--threads", str(threads)]
    if cost_tables is not None:
        parts += ["--cost-tables", str(cost_tables)]
    return shlex.join(parts)


def chat_sequences(
    target: Transformer,
    renderer: Any,
    eos_ids: frozenset[int],
    prompts: Sequence[ChatPrompt],
    seed: int,
    max_new_tokens: int = ANSWER_TOKENS,
) -> list[dict]:
    """The target's sampled answers to `prompts`, as `evaluate.load_chunks` gives sequences:
    `ids` (prompt + answer without its last token), `prompt_length`, `answer_length`, `kind`."""
    ids = [render(renderer, p) for p in prompts]
    answers = answer_all(
        target, ids, eos_ids, batch=min(64, len(ids)), max_new_tokens=max_new_tokens,
        temperature=TEMPERATURE, top_p=TOP_P, keep=1,
        generator=torch.Generator().manual_seed(seed),
    )  # fmt: skip
    sequences = []
    for prompt, prompt_ids, answer in zip(prompts, ids, answers, strict=True):
        tokens = answer["answer"].long()
        sequences.append(
            {
                "ids": torch.cat([torch.tensor(prompt_ids), tokens[:-1]]),
                "prompt_length": len(prompt_ids),
                "answer_length": len(tokens),
                "kind": prompt.kind,
            }
        )
    return sequences


def acceptance_table(chains: DraftChains) -> list[dict[str, float]]:
    """Per draft position: mean acceptance, its standard error over contexts (sd / sqrt(n),
    the binomial sqrt(a (1 - a) / n) when every context's value is 0 or 1), the context count."""
    n = chains.contexts
    accept = chains.accept.double()
    sd = accept.std(0, correction=1) if n > 1 else torch.full((accept.shape[1],), math.nan)
    return [
        {"position": k + 1, "acceptance": float(accept[:, k].mean()),
         "se": float(sd[k]) / math.sqrt(n), "contexts": n}
        for k in range(accept.shape[1])
    ]  # fmt: skip


def verification_outcomes(chains: DraftChains, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(labels, mask) [contexts, depth] as the served estimator sees them: every chain verified
    whole, position k accepted with probability `ratio`, labels up to the first rejection
    (`avspec.av.estimator.verification_labels`)."""
    generator = torch.Generator().manual_seed(seed)
    draws = torch.rand(chains.ratio.shape, generator=generator, dtype=torch.float64)
    accepted = (draws < chains.ratio.double()).long().cumprod(1).sum(1)
    verified = np.full(chains.contexts, chains.ratio.shape[1])
    return label_matrix(verified, accepted.numpy(), chains.ratio.shape[1])


def reliability(predicted: np.ndarray, observed: np.ndarray, weight: np.ndarray) -> list[dict]:
    """Per equal-width bin of `predicted` (BINS): label weight, mean predicted, observed rate
    (NaN for an empty bin)."""
    index = np.minimum((predicted * BINS).astype(np.int64), BINS - 1)
    rows = []
    for b in range(BINS):
        w = np.where(index == b, weight, 0.0)
        count = float(w.sum())
        means = [float((w * v).sum() / count) if count else math.nan for v in (predicted, observed)]
        rows.append(
            {"low": b / BINS, "high": (b + 1) / BINS, "labels": count,
             "mean_predicted": means[0], "observed": means[1]}
        )  # fmt: skip
    return rows


def calibration(chains: DraftChains, seed: int) -> dict[str, Any]:
    """AUCs of logit(q_max), and the served estimator fitted on the even contexts' verification
    labels, evaluated on the odd contexts' (reliability table, ECE, its sampling-noise floor,
    and the ECE against expected outcomes)."""
    accept, feature = chains.accept.double(), chains.feature.double()
    labels, mask = verification_outcomes(chains, seed)
    f = feature.numpy()
    result: dict[str, Any] = {
        "auc_soft_warped_all": soft_auc(logit(chains.q_max).flatten(), accept.flatten()),
        "auc_soft_warped_1": soft_auc(logit(chains.q_max[:, 0]), accept[:, 0]),
        "auc_soft_served_all": soft_auc(feature.flatten(), accept.flatten()),
        "auc_sampled_served": _auc_or_nan(f[mask], labels[mask]),
        "labels": int(mask.sum()),
    }
    fit_rows = np.arange(chains.contexts) % 2 == 0
    slope, intercepts = fit_logistic(f, labels, mask & fit_rows[:, None])
    held = mask & ~fit_rows[:, None]
    predicted = predict_logistic(f, slope, intercepts)
    p, y = predicted[held], labels[held]
    rng = np.random.default_rng(seed)
    redrawn = [(rng.random(p.size) < p).astype(np.float64) for _ in range(NOISE_DRAWS)]
    floor = [ece(p, r) for r in redrawn] if p.size else [math.nan]
    # Expected outcomes: position k of an odd chain is reached with probability prod_{j<k}
    # ratio_j and then accepted with probability ratio_k (no verification sampling).
    ratio = chains.ratio.double().numpy()
    reach = np.cumprod(np.concatenate([np.ones((ratio.shape[0], 1)), ratio[:, :-1]], 1), 1)
    odd = ~fit_rows
    soft_rows = reliability(predicted[odd].ravel(), ratio[odd].ravel(), reach[odd].ravel())
    soft_ece = sum(
        r["labels"] * abs(r["mean_predicted"] - r["observed"]) for r in soft_rows if r["labels"]
    ) / max(sum(r["labels"] for r in soft_rows), 1e-12)
    result |= {
        "slope": slope,
        "intercepts": [float(b) for b in intercepts],
        "fit_labels_by_position": (mask & fit_rows[:, None]).sum(0).tolist(),
        "fit_labels": int((mask & fit_rows[:, None]).sum()),
        "eval_labels": int(held.sum()),
        "reliability": reliability(p, y, np.ones_like(p)),
        "ece": ece(p, y) if p.size else math.nan,
        "ece_noise_mean": float(np.mean(floor)),
        "ece_noise_sd": float(np.std(floor)),
        "ece_expected_outcomes": soft_ece,
    }
    return result


def _auc_or_nan(scores: np.ndarray, labels: np.ndarray) -> float:
    both = 0 < labels.sum() < labels.size
    return auc(scores, labels) if both else math.nan


def _weights(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.safetensors"))


def same_weights(a: Path, b: Path) -> bool:
    """Whether two model directories are one (same path) or hold byte-identical weights."""
    if a.resolve() == b.resolve():
        return True
    files_a, files_b = _weights(a), _weights(b)
    if [f.name for f in files_a] != [f.name for f in files_b] or not files_a:
        return False
    for x, y in zip(files_a, files_b, strict=True):
        if x.stat().st_size != y.stat().st_size:
            return False
        digests = [hashlib.sha256(f.read_bytes()).digest() for f in (x, y)]
        if digests[0] != digests[1]:
            return False
    return True


def cost_pair(measured: dict, target_dir: Path, draft_dir: Path) -> tuple[bool, str]:
    """Whether a cost file's `measured` block says it was measured on this pair, and why not.

    The file names its pair only by directories ("T + D (dtype)", client/profile_costs.py,
    relative to where it ran) and the date. It is this pair's when the named directories hold
    this pair's weights (`same_weights`) and were last written before the measurement (a file
    measured before other weights were moved to the same paths is another pair's)."""
    models = measured.get("models")
    if not isinstance(models, str):
        return False, "the file does not say which pair it was measured on"
    named = re.match(r"(\S+) \+ (\S+)", models)
    if named is None:
        return False, f"the file was measured on {models}"
    pairs = list(zip(map(Path, named.groups()), (target_dir, draft_dir), strict=True))
    for theirs, ours in pairs:
        if not theirs.is_dir():
            return False, f"the file was measured on {models}; {theirs} is not here to compare"
        if not same_weights(theirs, ours):
            return False, f"the file was measured on {models}: {theirs} is not {ours}"
    try:
        date = datetime.fromisoformat(str(measured.get("date"))).timestamp()
    except ValueError:
        return False, f"the file names {models} but not when it was measured"
    for theirs, _ in pairs:
        written = max((f.stat().st_mtime for f in _weights(theirs)), default=0.0)
        if written > date:
            when = datetime.fromtimestamp(written, UTC).isoformat(timespec="seconds")
            return False, (
                f"the file names {models} but was measured {measured['date']}, before the "
                f"weights in {theirs} were written ({when}): another pair at those paths"
            )
    return True, f"measured on {models}, {measured['date']}, the same weights as this pair"


def cost_section(path: Path | str, target_dir: Path, draft_dir: Path) -> dict[str, Any]:
    """The cost file's provenance and, when it is this pair's (`cost_pair`), at each of
    COST_ROWS rows: a draft pass, a target step of one token per row (`verify_ms`, without the
    per-step overhead), their ratio, and `verify_to_draft_ratio` at DEPTH drafts."""
    path = Path(path)
    cost = load_step_cost(path)
    measured = json.loads(path.read_text(encoding="utf-8")).get("measured", {})
    ours, why = cost_pair(measured, target_dir, draft_dir)
    section: dict[str, Any] = {
        "file": str(path),
        "this_pair": ours,
        "why": why,
        "provenance": {k: measured.get(k) for k in ("models", "date", "device", "command")},
    }
    if ours:
        section["rows"] = [
            {"rows": r, "draft_pass_ms": cost.draft_pass.at(r),
             "target_step_ms": cost.verify_ms(r, r),
             "ratio": cost.verify_ms(r, r) / cost.draft_pass.at(r),
             "verify_to_draft_ratio": cost.verify_to_draft_ratio(r, DEPTH)}
            for r in COST_ROWS
        ]  # fmt: skip
    return section


def greedy_samples(
    models: dict[str, Transformer], renderer: Any, tokenizer: Any, prompts: Sequence[str]
) -> dict[str, list[str]]:
    """Each model's greedy answer (up to SAMPLE_TOKENS tokens, EOS dropped) to each prompt."""
    ids = [render(renderer, ChatPrompt("sample", "", p)) for p in prompts]
    samples = {}
    for name, model in models.items():
        answers = answer_all(
            model, ids, tokenizer.eos_ids, batch=len(ids), max_new_tokens=SAMPLE_TOKENS,
            temperature=0.0, top_p=1.0, keep=1, generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        texts = []
        for a in answers:
            tokens = [t for t in a["answer"].tolist() if t not in tokenizer.eos_ids]
            texts.append(tokenizer.decode(tokens))
        samples[name] = texts
    return samples


def describe_model(directory: Path, model: Transformer) -> dict[str, Any]:
    """Shape, parameters, stored weights and (for a GGUF conversion) the source of one model."""
    c = model.config
    config = json.loads((directory / "config.json").read_text())
    info: dict[str, Any] = {
        "directory": str(directory),
        "architecture": (config.get("architectures") or ["?"])[0],
        "layers": c.num_layers,
        "width": c.width,
        "heads": c.num_heads,
        "kv_heads": c.num_kv_heads,
        "intermediate": c.intermediate_size,
        "vocab": c.vocab_size,
        "tied": c.tie_embeddings,
        "parameters": model.num_parameters(),
        "stored_dtype": config.get("torch_dtype", "?"),
        "weights_bytes": sum(
            p.stat().st_size for p in directory.glob("*.safetensors") if p.name != LAYERS_FILE
        ),
    }
    if (directory / SHARED_EMBEDDING_FILE).is_file():  # stored without the target's embedding
        info["shared_embedding"] = json.loads((directory / SHARED_EMBEDDING_FILE).read_text())
        info["stored_bytes"] = (directory / LAYERS_FILE).stat().st_size
    source = directory / "gguf_source.json"
    if source.is_file():
        gguf = json.loads(source.read_text())
        info["gguf"] = gguf
        info["pinned"] = gguf.get("sha256") == SMOLLM2_135M_INSTRUCT.gguf_sha256
    report = directory / "training_report.json"
    if report.is_file():
        info["training_report"] = json.loads(report.read_text())
    return info


def measure_card(
    target_dir: Path | str,
    draft_dir: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    cost_tables: Path | str | None = None,
) -> dict[str, Any]:
    """Every figure of the card (plain data; `render_card` writes it)."""
    begin = time.perf_counter()
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    # The cost file first: a malformed one fails before minutes of measuring.
    cost = None if cost_tables is None else cost_section(cost_tables, target_dir, draft_dir)
    max_length = MAX_PROMPT_TOKENS + max(ANSWER_TOKENS, SAMPLE_TOKENS) + DEPTH
    target = load_model(target_dir, dtype=DTYPE, max_length=max_length)
    draft = load_model(draft_dir, dtype=DTYPE, max_length=max_length)
    vocab = resolve_draft_vocab(draft_dir, DRAFT_VOCAB_AUTO, draft.config.vocab_size)
    renderer = chat_renderer(target_dir)
    tokenizer = load_tokenizer(target_dir)
    _, held_out = split_files(corpus_files())
    prompts = build_prompts(held_out, contexts, seed)
    sequences = chat_sequences(target, renderer, tokenizer.eos_ids, prompts, seed)
    chains = draft_chains(served_draft(draft, vocab), target, sequences, DEPTH, 1, seed)
    same_tokenizer = (target_dir / "tokenizer.json").read_bytes() == (
        draft_dir / "tokenizer.json"
    ).read_bytes()
    card: dict[str, Any] = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s)",
        "target": describe_model(target_dir, target),
        "draft": describe_model(draft_dir, draft),
        "same_tokenizer": same_tokenizer,
        "contexts": contexts,
        "draft_vocab": None if vocab is None else len(vocab.token_ids),
        "seed": seed,
        "kinds": sorted({p.kind for p in prompts}),
        "mean_prompt_tokens": float(np.mean([s["prompt_length"] for s in sequences])),
        "mean_answer_tokens": float(np.mean([s["answer_length"] for s in sequences])),
        "acceptance": acceptance_table(chains),
        "calibration": calibration(chains, seed + 1),
        "samples": {
            "prompts": list(SAMPLE_PROMPTS),
            **greedy_samples(
                {"target": target, "draft": draft}, renderer, tokenizer, SAMPLE_PROMPTS
            ),
        },
    }
    if cost is not None:
        card["cost"] = cost
    card["seconds"] = time.perf_counter() - begin
    return card


def write_card(
    target_dir: Path | str,
    draft_dir: Path | str,
    out: Path | str,
    contexts: int = CONTEXTS,
    seed: int = 0,
    cost_tables: Path | str | None = None,
    threads: int = 1,
) -> dict[str, Any]:
    """Measure the pair and write its card to `out`; returns the measurements."""
    card = measure_card(target_dir, draft_dir, contexts, seed, cost_tables)
    command = card_command(target_dir, draft_dir, out, contexts, seed, threads, cost_tables)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render_card(card, command), encoding="utf-8")
    return card


def read_acceptance_table(text: str) -> list[dict[str, float]]:
    """The acceptance-by-position rows of a card written by `render_card`."""
    lines = text.splitlines()
    start = lines.index(ACCEPTANCE_HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        position, acceptance, se, contexts = (c.strip() for c in line.strip("|").split("|"))
        rows.append(
            {"position": int(position), "acceptance": float(acceptance), "se": float(se),
             "contexts": int(contexts)}
        )  # fmt: skip
    return rows


def disagreements(
    card: Sequence[dict[str, float]], rerun: Sequence[dict[str, float]], sigmas: float = 4.0
) -> list[int]:
    """Positions where two acceptance tables differ by more than `sigmas` combined standard
    errors (sqrt(se_a^2 + se_b^2)); a position missing from either table counts as one."""
    by_position = {r["position"]: r for r in rerun}
    bad = []
    for row in card:
        other = by_position.get(row["position"])
        if other is None:
            bad.append(row["position"])
            continue
        bound = sigmas * math.hypot(row["se"], other["se"])
        if not abs(row["acceptance"] - other["acceptance"]) <= bound:
            bad.append(row["position"])
    return bad + sorted(set(by_position) - {r["position"] for r in card})


def _f(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def render_card(card: dict[str, Any], command: str) -> str:
    """The Markdown card of `measure_card`'s figures, headed by the command that remakes it."""
    t, d = card["target"], card["draft"]
    lines = [
        f"# Model card: {Path(t['directory']).name} (target) + {Path(d['directory']).name} "
        "(draft)",
        "",
        "Regenerate (the figures below are measurements: a rerun with another `--seed` agrees",
        "within the standard errors):",
        "",
        "```bash",
        command,
        "```",
        "",
        f"Measured {card['date']} on {card['machine']} in {card['seconds'] / 60:.1f} min; both",
        "models in bf16 on the project's runtime (`avspec.runtime`), sampling as served:",
        f"temperature {TEMPERATURE}, top-p {TOP_P}.",
    ]
    lines += _pair_section(card)
    lines += _acceptance_section(card)
    lines += _calibration_section(card["calibration"])
    lines += _cost_section(card.get("cost"), command)
    lines += _samples_section(card["samples"])
    return "\n".join(lines) + "\n"


def _pair_section(card: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## The pair",
        "",
        "| model | directory | layers | width | heads (kv) | MLP | vocab | parameters | weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in ("target", "draft"):
        m = card[name]
        lines.append(
            f"| {name} | `{m['directory']}` | {m['layers']} | {m['width']} "
            f"| {m['heads']} ({m['kv_heads']}) | {m['intermediate']} | {m['vocab']:,} "
            f"| {m['parameters']:,} | {m['weights_bytes'] / 1e6:.1f} MB {m['stored_dtype']} |"
        )
    t, d = card["target"], card["draft"]
    lines.append("")
    if "gguf" in t:
        g = t["gguf"]
        pin = SMOLLM2_135M_INSTRUCT
        origin = (
            f"the pinned GGUF (`{pin.requirement}`, member `{pin.member}`, "
            "`avspec.runtime.gguf.pins`)"
            if t.get("pinned")
            else "a GGUF that is not the pinned one"
        )
        lines += [
            f"Target: {t['architecture']} converted from `{g.get('file')}` (sha256 "
            f"`{str(g.get('sha256'))[:16]}...`, GGUF name \"{g.get('name')}\"), {origin}, "
            "by `avspec.tools.setup.fetch_target` (converter version "
            f"{g.get('converter_version')}, "
            f"{g.get('dtype')}); tensor types in the GGUF: "
            + ", ".join(f"{k} {v}" for k, v in sorted(g.get("tensor_types", {}).items()))
            + ".",
        ]
    else:
        lines.append(f"Target: a {t['architecture']} checkpoint (no `gguf_source.json`).")
    tied = "tied" if d["tied"] else "untied"
    tokenizer = (
        "the same `tokenizer.json` as the target"
        if card["same_tokenizer"]
        else "**not the target's `tokenizer.json`**"
    )
    lines += [
        "",
        f"Draft: {d['architecture']}, {d['layers']} layers of width {d['width']}, {tied} "
        f"embeddings; {d['parameters'] / 1e6:.2f} M parameters, of which the embedding holds "
        f"{d['vocab'] * d['width'] / 1e6:.2f} M. Tokenizer: {tokenizer}."
        + (
            ""
            if "shared_embedding" not in d
            else f" The embedding is the target's, bit for bit (sha256 "
            f"`{d['shared_embedding']['sha256'][:16]}...`): the directory stores the rest in "
            f"`{LAYERS_FILE}` ({d['stored_bytes'] / 1e6:.1f} MB) and `make models` joins the two "
            "(`avspec.tools.train.draft_embedding`)."
        ),
    ]
    report = d.get("training_report")
    if report:
        lines += ["", *_training_lines(report)]
    else:
        lines += ["", "No `training_report.json` in the draft directory: no training summary."]
    return lines


def _shape(training: dict[str, Any]) -> str:
    """ ", from the target's blocks 0, 1, 2 over its frozen embedding" for a target-layers
    draft's training summary; "" otherwise."""
    layers = training.get("shape", {}).get("target_layers")
    if not layers:
        return ""
    return f", from the target's blocks {', '.join(map(str, layers))} over its frozen embedding"


def _training_lines(report: dict[str, Any]) -> list[str]:
    """The draft's training summary, from what `avspec.tools.train.draft.report` writes."""
    tr, held = report.get("training", {}), report.get("heldout", {})
    last = report.get("last_log", {})
    parts = []
    if tr:
        parts.append(
            f"{tr.get('step', '?')} steps in {tr.get('elapsed', 0) / 60:.0f} min, "
            f"{tr.get('seen', 0):,} answer positions seen"
        )
    if "train_kl" in last:
        parts.append(f"last training KL {last['train_kl']:.3f} nats")
    if held:
        parts.append(
            f"held-out acceptance at position 1 {_f(held.get('acceptance_1', math.nan))} and AUC "
            f"of logit(q_max) {_f(held.get('auc_logit_q_max', math.nan))} over "
            f"{held.get('positions', '?')} positions of target-written held-out answers (the "
            "fp32 checkpoint, before the bf16 save)"
        )
    raw = report.get("heldout_raw")
    if raw:
        parts.append(
            f"on raw completions held out (code and prose prefixes, no chat template) "
            f"{_f(raw.get('acceptance_1', math.nan))} and "
            f"{_f(raw.get('auc_logit_q_max', math.nan))} over {raw.get('positions', '?')}"
        )
    start = report.get("init", {})
    if "init_from" in tr and start:
        before = [f"{_f(start[k]['acceptance_1'])} ({k.replace('_', ' ')})"
                  for k in ("heldout", "heldout_raw") if k in start]  # fmt: skip
        parts.append(f"the draft it started from, on the same answers: {', '.join(before)}")
    text = "; ".join(parts) if parts else "no figures"
    what = "target-answered chat prompts of the train split"
    if raw:
        what += " and raw code / prose prefixes the target continued"
    origin = _shape(tr)
    if "init_from" in tr:
        origin += f"; this run a fine-tune of the draft in `{tr['init_from']}`"
    return [
        "Draft training (`training_report.json`, `python -m avspec.tools.train.draft`: top-64 KL",
        f"distillation on {what}{origin}): {text}.",
    ]


def _acceptance_section(card: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Acceptance by draft position",
        "",
        f"{card['contexts']} chat prompts of the held-out split (kinds: "
        f"{', '.join(card['kinds'])}; `avspec.tools.train.draft.prompts`, seed {card['seed']}) in "
        "the",
        f"target's chat template (mean {card['mean_prompt_tokens']:.0f} tokens), answered by the "
        f"target (mean {card['mean_answer_tokens']:.0f} tokens, at most {ANSWER_TOKENS}). Each",
        "context is a prompt plus a uniformly drawn share of its answer; the draft drafts",
        f"{DEPTH} tokens from it autoregressively, sampling its warped distribution q, and the",
        "target's warped p is taken at each drafted context. An entry is the mean over contexts",
        "of sum_v min(p(v), q(v)), the chance speculative sampling accepts that position's draft",
        "given the drafts before it (`avspec.tools.train.draft.evaluate.draft_chains`); s.e. is "
        "its",
        "standard error over contexts, sd / sqrt(n) (the binomial sqrt(a(1-a)/n) for 0/1 values).",
        *(
            []
            if card.get("draft_vocab") is None
            else [
                f"q is the draft's as served: over the {card['draft_vocab']:,} kept ids of its "
                "draft vocabulary (`draft_vocab.json`), 0 elsewhere."
            ]
        ),
        "",
        ACCEPTANCE_HEADER,
        "|---|---|---|---|",
    ]
    for row in card["acceptance"]:
        lines.append(
            f"| {row['position']} | {_f(row['acceptance'])} | {_f(row['se'])} "
            f"| {row['contexts']} |"
        )
    lines += [
        "",
        "A draft at depth k is used only if the k - 1 before it were accepted, so the chance of",
        "reaching depth k falls roughly as the product of the entries before it.",
    ]
    return lines


def _calibration_section(cal: dict[str, Any]) -> list[str]:
    lines = [
        "",
        "## Calibration of logit(q_max)",
        "",
        "The same contexts and drafts. Soft AUC: the probability that a position drawn by its",
        "acceptance scores above one drawn by its rejection, in expectation over the outcomes",
        "(`evaluate.soft_auc`, no sampling noise). Sampled: verification outcomes drawn as the",
        "server draws them (each chain verified whole, a draft accepted with probability",
        "min(1, p(x)/q(x)), labels up to the first rejection), AUC by `avspec.av.calibration`.",
        "The served feature is logit q_max of the temperature-scaled draft distribution (no",
        "top-p; `avspec.av.features`); the draft's training report scores the warped q.",
        "",
        "| score | outcomes | positions | AUC |",
        "|---|---|---|---|",
        f"| logit q_max, warped q | soft | 1 | {_f(cal['auc_soft_warped_1'])} |",
        f"| logit q_max, warped q | soft | 1-{DEPTH} | {_f(cal['auc_soft_warped_all'])} |",
        f"| served feature | soft | 1-{DEPTH} | {_f(cal['auc_soft_served_all'])} |",
        f"| served feature | sampled ({cal['labels']} labels) | labelled "
        f"| {_f(cal['auc_sampled_served'])} |",
        "",
        "The online estimator's model, p = sigmoid(w f + b_k) with one slope and one intercept",
        "per position (`avspec.av.estimator`), fitted to convergence by the refit's Newton step",
        "(`avspec.tools.train.features_zoo.fit_logistic`) on the sampled labels of the "
        "even-numbered "
        f"contexts ({cal['fit_labels']} labels): w = {cal['slope']:.3f}, b_k (labels) = "
        + ", ".join(
            f"{b:.2f} ({n})" if n else "- (0)"
            for b, n in zip(cal["intercepts"], cal["fit_labels_by_position"], strict=True)
        )
        + f". Reliability on the odd-numbered contexts ({cal['eval_labels']} labels, {BINS} "
        "equal-width bins of the prediction):",
        "",
        "| predicted | labels | mean predicted | observed |",
        "|---|---|---|---|",
    ]
    for r in cal["reliability"]:
        lines.append(
            f"| {r['low']:.1f}-{r['high']:.1f} | {r['labels']:.0f} | {_f(r['mean_predicted'])} "
            f"| {_f(r['observed'])} |"
        )
    lines += [
        "",
        f"Fitted ECE on the held-out half: **{_f(cal['ece'])}** (`avspec.av.calibration.ece`, as",
        "client/eval_estimator.py computes it). At this label count a perfectly calibrated",
        f"estimator would show {_f(cal['ece_noise_mean'])} +- {_f(cal['ece_noise_sd'])} from "
        f"sampling alone (labels redrawn from its own predictions, {NOISE_DRAWS} times). Against",
        "expected outcomes instead of sampled ones (position k weighted by the chance it is",
        f"verified, observed = min(1, p(x)/q(x))) the ECE is {_f(cal['ece_expected_outcomes'])}.",
    ]
    return lines


def _cost_section(cost: dict[str, Any] | None, command: str) -> list[str]:
    lines = ["", "## Cost ratio", ""]
    if cost is None:
        return lines + [
            "Not measured: no cost-tables file was given. Profile this pair with",
            "`python client/profile_costs.py --target-dir TARGET --draft-dir DRAFT --output FILE`",
            "and pass `--cost-tables FILE` to the command above.",
        ]
    p = cost["provenance"]
    where = f"{p.get('models')}, {p.get('date')}, {p.get('device')}"
    lines.append(f"From `{cost['file']}` (measured on {where}).")
    if not cost["this_pair"]:
        return lines + [
            "",
            f"**Not this pair**: {cost['why']}. Its figures are left out rather than mixed into",
            "this card; profile this pair with `python client/profile_costs.py --target-dir "
            "TARGET --draft-dir DRAFT --output FILE`.",
        ]
    lines += [
        "A target step runs one token per row (`StepCost.verify_ms`, the per-step overhead of",
        "the served path left out); a draft pass runs the same rows. The last column is",
        f"`verify_to_draft_ratio` at {DEPTH} drafts a row (target ms per verified token over",
        "draft ms per row of a pass).",
        "",
        "| rows | draft pass ms | target step ms | target / draft | verify_to_draft_ratio |",
        "|---|---|---|---|---|",
    ]
    for r in cost["rows"]:
        lines.append(
            f"| {r['rows']} | {r['draft_pass_ms']:.2f} | {r['target_step_ms']:.2f} "
            f"| {r['ratio']:.2f} | {r['verify_to_draft_ratio']:.2f} |"
        )
    return lines


def _samples_section(samples: dict[str, list[str]]) -> list[str]:
    lines = [
        "",
        f"## Greedy answers (at most {SAMPLE_TOKENS} tokens, the target's chat template)",
        "",
        "Decoded as served (bf16, the KV-cached path): bf16 logits are coarse (0.125 apart near",
        "25), so where two tokens nearly tie a float32 run may pick the other one.",
    ]
    for i, prompt in enumerate(samples["prompts"]):
        lines += ["", f"**{prompt}**", ""]
        for name in ("target", "draft"):
            text = samples[name][i].replace("```", "'''")
            lines += [f"{name}:", "", "```text", text, "```", ""]
    return lines[:-1]
