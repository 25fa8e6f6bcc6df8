"""The figures of a (target, draft) pair's model card, measured on the project's runtime.

Both models in bf16 (`DTYPE`) at the served sampling setting (`evaluate.TEMPERATURE`,
`evaluate.TOP_P`): the target's answers to chat prompts (`chat_sequences`), acceptance by
draft position over the contexts cut from them (`acceptance_table` of
`evaluate.draft_chains`), the calibration of logit(q_max) and of the served estimator's model
(`calibration`), greedy answers (`greedy_samples`) and each model's shape and source
(`describe_model`). `avspec.tools.train.draft.model_card` puts them together; plain data only.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avspec.av.calibration import auc, ece
from avspec.runtime.gguf.pins import SMOLLM2_135M_INSTRUCT
from avspec.runtime.hf_files import SHARED_EMBEDDING_FILE
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.evaluate import TEMPERATURE, TOP_P, DraftChains, logit, soft_auc
from avspec.tools.train.draft.generate import AnswerSettings, answer_all, render
from avspec.tools.train.draft.prompts import ChatPrompt
from avspec.tools.train.draft_embedding import LAYERS_FILE
from avspec.tools.train.features_zoo import fit_logistic, label_matrix, predict_logistic

DEPTH = 8
CONTEXTS = 256
ANSWER_TOKENS = 64  # target answer tokens per prompt; contexts end inside them
BINS = 10
NOISE_DRAWS = 200
DTYPE = torch.bfloat16
SAMPLE_TOKENS = 48
SAMPLE_PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that reverses a string.",
    "What does HTTP stand for?",
    "Explain what a Python list comprehension is in one sentence.",
)


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
    settings = AnswerSettings(min(64, len(ids)), max_new_tokens, TEMPERATURE, TOP_P, keep=1)
    answers = answer_all(target, ids, eos_ids, settings, torch.Generator().manual_seed(seed))
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


def greedy_samples(
    models: dict[str, Transformer], renderer: Any, tokenizer: Any, prompts: Sequence[str]
) -> dict[str, list[str]]:
    """Each model's greedy answer (up to SAMPLE_TOKENS tokens, EOS dropped) to each prompt."""
    ids = [render(renderer, ChatPrompt("sample", "", p)) for p in prompts]
    samples = {}
    for name, model in models.items():
        settings = AnswerSettings(len(ids), SAMPLE_TOKENS, temperature=0.0, top_p=1.0, keep=1)
        answers = answer_all(
            model, ids, tokenizer.eos_ids, settings, torch.Generator().manual_seed(0)
        )
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
