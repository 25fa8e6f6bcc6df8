"""Tiny float64 models, stages and step inputs for exact checks of the stages and the step."""

from __future__ import annotations

import torch

from avspec.contract import StepInputs
from avspec.engine.draft_stage import DraftStage
from avspec.engine.target_stage import TargetStage
from avspec.runtime.transformer import Transformer, TransformerConfig

K = 4


def tiny_model(seed: int, layers: int = 2, width: int = 32, **config: object) -> Transformer:
    """A float64 random-weight model with peaked, non-trivial logits, for exact checks
    (`config`: further `TransformerConfig` fields, e.g. a Llama form's mlp="swiglu").

    GPT-style init makes a random model repeat its input (tied embeddings); unit-scale weights
    and a random final-norm gain give varied, peaked distributions instead.
    """
    model = Transformer(
        TransformerConfig(num_layers=layers, width=width, num_heads=2, max_length=96, **config)
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") and name != "final_norm.weight":
                param.fill_(1.0)
            elif name.startswith("blocks"):
                param.normal_(0.0, param.shape[1] ** -0.5, generator=gen)
            else:
                param.normal_(0.0, 1.0, generator=gen)
    return model.double().eval()


def perturbed(model: Transformer, noise: float, seed: int) -> Transformer:
    """A copy of `model` with relative Gaussian noise on every weight: a partly agreeing draft."""
    copy = Transformer(model.config).double().eval()
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in copy.parameters():
            param.add_(
                torch.randn(param.shape, generator=gen, dtype=param.dtype) * noise * param.std()
            )
    return copy


def make_draft_stage(model: Transformer, **kw) -> DraftStage:
    """A draft stage with K drafts and a float64 cache of 8 sequences x 96 positions."""
    return DraftStage(model, model.new_cache(8, 96, "cpu", torch.float64), K, **kw)


def make_target_stage(model: Transformer, **kw) -> TargetStage:
    """A target stage with K drafts and a float64 cache of 8 sequences x 96 positions."""
    return TargetStage(model, model.new_cache(8, 96, "cpu", torch.float64), K, **kw)


def make_inputs(
    rows: list[dict], prev: list[int] | None = None, release: list[int] = ()
) -> StepInputs:
    """StepInputs from per-row dicts with keys seq_id, tokens, start, reusable, n (+ optional)."""
    width = max(len(r["tokens"]) for r in rows) if rows else 1
    ids = torch.zeros(len(rows), width, dtype=torch.int32)
    for i, r in enumerate(rows):
        ids[i, : len(r["tokens"])] = torch.tensor(r["tokens"])

    def col(key: str, default, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([r.get(key, default) for r in rows], dtype=dtype)

    return StepInputs(
        seq_ids=col("seq_id", 0, torch.int64),
        input_ids=ids,
        input_lengths=torch.tensor([len(r["tokens"]) for r in rows], dtype=torch.int32),
        start_positions=col("start", 0, torch.int32),
        reusable=col("reusable", 0, torch.int32),
        num_draft_tokens=col("n", K, torch.int32),
        adaptive=col("adaptive", False, torch.bool),
        temperature=col("temperature", 1.0, torch.float32),
        top_p=col("top_p", 1.0, torch.float32),
        random_seed=col("seed", 0, torch.int64),
        prev_num_accepted=torch.tensor(prev or [], dtype=torch.int32),
        release_seq_ids=torch.tensor(list(release), dtype=torch.int64),
    )
