"""The Markdown text of a model card, from `measure_card`'s figures, and the way back.

`render_card` writes the sections (the pair and the draft's training summary, acceptance by
position, calibration, cost ratio, greedy answers) under the command that remakes the card;
`read_acceptance_table` reads the acceptance rows back from a written card.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.tools.train.draft.card_drafters import render_drafters
from avspec.tools.train.draft.card_measure import (
    ANSWER_TOKENS,
    BINS,
    DEPTH,
    NOISE_DRAWS,
    SAMPLE_TOKENS,
)
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P
from avspec.tools.train.draft_embedding import LAYERS_FILE

ACCEPTANCE_HEADER = "| position | acceptance | s.e. | contexts |"


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
    if "drafters" in card:
        lines += ["", *render_drafters(card["drafters"])]
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
