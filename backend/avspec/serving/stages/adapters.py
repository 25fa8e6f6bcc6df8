"""The Triton-free bodies of the draft, target and verifier models: one adapter per stage.

Each adapter is built once from its parsed parameters and called with the request's input
tensors as torch tensors named as in its config.pbtxt; it returns its output tensors in the
contract's dtypes, on the device its stage computed them on. One code path for CPU and GPU: a
CPU model hands in numpy views and sends numpy copies back, a GPU variant (configs/gpu.pbtxt)
keeps device tensors on the device through DLPack; that hand-over is the model class's
(avspec.serving.stages.triton_model), and the device a parameter. So everything here runs in unit
tests without a server.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from avspec.av.cost_file import default_step_cost, load_step_cost
from avspec.av.cost_refresh import CostRefresh
from avspec.av.estimator import AcceptanceEstimator, accepted_counts
from avspec.av.snapshot import (
    SnapshotError,
    load_snapshot,
    move_aside,
    save_snapshot,
    snapshot_pair,
)
from avspec.av.step_cost import StepCost
from avspec.av.step_log import StepLog
from avspec.av.verifier import AdaptiveVerifier, VerifyDecision
from avspec.config import EstimatorConfig
from avspec.contract import FEATURE_OUTPUTS, VerifierInputs, base_tokens
from avspec.engine.draft_stage import DraftStage
from avspec.engine.draft_vocab import resolve_draft_vocab
from avspec.engine.head_stage import HeadDraftStage
from avspec.engine.stage import ModelStage, StageCache, StageModel
from avspec.engine.target_stage import TargetStage
from avspec.runtime.engine_choice import choose_engine
from avspec.runtime.head import DraftHead, is_head_dir, load_head_dir
from avspec.runtime.precision import load_served_model, resolve_precision
from avspec.serving.repository import (
    HOST_COST_TABLES,
    StageParams,
    VerifierParams,
    is_path_value,
    resolve_path,
    step_inputs_from_tensors,
)

logger = logging.getLogger(__name__)

# A request's tensors by name, as in the model's config.pbtxt.
Tensors = Mapping[str, torch.Tensor]

# Linear fallback sizes when no measured cost tables exist.
FALLBACK_MAX_SEQUENCES = 128
FALLBACK_MAX_TOKENS = 128 * 512


def load_cost_tables(path: Path | None) -> StepCost:
    """The StepCost of the profiler's JSON (avspec.av.cost_file), or linear defaults.

    A missing path or file falls back to `default_step_cost` with a logged warning; a file that
    exists but is malformed raises ValueError (a broken measurement must not pass).
    """
    if path is None or not path.is_file():
        logger.warning(
            "cost tables %s not found: using linear defaults (measure them: in-process with "
            "client/profile_costs.py, on a deployment with client/profile_serving_costs.py)",
            path,
        )
        return default_step_cost(FALLBACK_MAX_SEQUENCES, FALLBACK_MAX_TOKENS)
    return load_step_cost(path)


def load_estimator(
    config: EstimatorConfig, snapshot: Path | None, device: str, pair_id: str = ""
) -> AcceptanceEstimator:
    """Warm start: restore the snapshot if there is one, else the starting values.

    With `pair_id` (the served pair's identity), a snapshot recorded for another pair is
    ignored with one log line naming both identities and left in place (it is valid for its
    own pair); one recording no pair (older snapshots) is accepted, and that is logged.

    A missing file starts fresh silently. An unreadable, mismatched or out-of-bounds one is
    logged (file and field), moved aside to `<name>.invalid-<time>` and the estimator starts
    from the configured values: left in place, a bad file would be read again on every restart
    until a save replaced it, and a state that cannot be saved (inf slope) never would be.
    """
    if snapshot is None or not snapshot.is_file():
        return AcceptanceEstimator(config, device)
    recorded = snapshot_pair(snapshot)
    if pair_id and recorded is not None and recorded != pair_id:
        logger.warning(
            "ignoring estimator snapshot %s: fitted on pair %s, serving pair %s; starting from "
            "the configured values",
            snapshot,
            recorded,
            pair_id,
        )
        return AcceptanceEstimator(config, device)
    if pair_id and recorded is None:
        logger.info("estimator snapshot %s records no pair: accepting it for %s", snapshot, pair_id)
    try:
        estimator = load_snapshot(snapshot, config, device)
    except SnapshotError as err:
        try:
            where = f"moved to {move_aside(snapshot)}"
        except OSError as move_err:  # e.g. a second instance moved it first
            where = f"could not move it aside: {move_err}"
        logger.warning(
            "ignoring estimator snapshot%s: %s; %s; starting from the configured "
            "values, the next refit writes a fresh snapshot",
            f" (field {err.field})" if err.field else "",
            err,
            where,
        )
        return AcceptanceEstimator(config, device)
    logger.info("estimator restored from %s", snapshot)
    return estimator


class StageAdapter(ABC):
    """A model stage behind a Triton model: model directory + KV cache + stage object.

    A subclass per stage names its stage class and turns the request's tensors into the
    stage's call; STAGE_ADAPTERS picks one by stage name.
    """

    stage_class: ClassVar[type[ModelStage]]

    def __init__(self, params: StageParams, root: Path) -> None:
        model, cache = load_stage_model(params, root)
        extra: dict[str, Any] = {}
        stage_class = self.stage_class
        if isinstance(model, DraftHead):
            stage_class = HeadDraftStage
        if params.emit_features:
            if self.stage_class is not TargetStage:
                raise ValueError("emit_features is a parameter of the target model only")
            extra["emit_features"] = True
        if params.draft_top_k:
            if self.stage_class is not DraftStage:
                raise ValueError("draft_top_k is a parameter of the draft model only")
            extra["top_k"] = params.draft_top_k
        if params.draft_vocab:
            if self.stage_class is not DraftStage:
                raise ValueError("draft_vocab is a parameter of the draft model only")
            model_dir = resolve_path(root, params.model_dir)
            width = params.vocab_limit or model.vocab_size
            vocab = resolve_draft_vocab(model_dir, params.draft_vocab, width)
            if vocab is None:
                logger.info("draft vocabulary: the whole vocabulary (%s has no map)", model_dir)
            else:
                extra["draft_vocab"] = vocab
                logger.info("draft vocabulary %s: %d of %d ids (%s)", vocab.path, len(vocab),
                            width, vocab.source)  # fmt: skip
        self.stage = stage_class(
            model,  # type: ignore[arg-type]
            cache,
            params.max_draft_tokens,
            idle_timeout_s=params.idle_timeout_s,
            vocab_limit=params.vocab_limit or None,
            **extra,
        )

    @property
    def live_sequences(self) -> int:
        """Sequences holding a KV cache slot (the av_kv_live_sequences gauge)."""
        return int(self.stage.cache.num_live)

    @abstractmethod
    def __call__(self, tensors: Tensors) -> dict[str, torch.Tensor]:
        """The stage's output tensors for one request's input tensors."""


def load_stage_model(params: StageParams, root: Path) -> tuple[StageModel | DraftHead, StageCache]:
    """The stage's model and KV cache on its engine: the checkpoint in `dtype` on torch, or
    the GGUF file on llama.cpp (sized for `max_sequences` rows of K + 1 logits each)."""
    model_dir = resolve_path(root, params.model_dir)
    if is_head_dir(model_dir):  # a draft head: the torch runtime, its own one-block cache
        dtype = resolve_precision(params.dtype, params.device).dtype
        head = load_head_dir(model_dir, params.device, dtype, params.max_length)
        return head, head.layers.new_cache(
            params.max_sequences, params.max_length, params.device, pool_tokens=params.pool_tokens
        )
    engine = params.engine
    if engine == "auto":  # the launcher resolves it for both stages; a bare repository here
        engine, why = choose_engine([resolve_path(model_dir, params.gguf)])
        logger.info("engine %s: %s", engine, why)
    if engine == "llamacpp":
        from avspec.runtime.llamacpp.model import EngineSettings, GGUFModel  # noqa: PLC0415

        settings = EngineSettings(
            max_sequences=params.max_sequences,
            pool_tokens=params.pool_tokens,
            max_outputs=params.max_sequences * (params.max_draft_tokens + 1),
            threads=params.threads,
            max_length=params.max_length,
            flash_attention=params.flash_attention,
            features=params.emit_features,  # a draft head reads the target's final-norm output
        )
        gguf = GGUFModel(resolve_path(model_dir, params.gguf), settings)
        return gguf, gguf.new_cache()
    model = load_served_model(model_dir, params.device, params.dtype, max_length=params.max_length)
    cache = model.new_cache(
        params.max_sequences, params.max_length, params.device, pool_tokens=params.pool_tokens
    )
    return model, cache


class DraftAdapter(StageAdapter):
    """Step inputs in; drafts [batch, K] int32, q [batch, K, vocab], features [batch, K],
    num_drafted [batch] and the passes' ms [K] out."""

    stage_class = DraftStage

    def __call__(self, tensors: Tensors) -> dict[str, torch.Tensor]:
        out = self.stage(step_inputs_from_tensors(tensors))  # type: ignore[operator]
        return {
            "draft_tokens": out.draft_tokens,
            "draft_probs": out.draft_probs,
            "draft_features": out.draft_features,
            "num_drafted": out.num_drafted,
            "draft_ms": out.pass_ms,
        }


class TargetAdapter(StageAdapter):
    """Step inputs, drafts and num_verify in; output_ids [batch, K + 1], num_accepted, ms out."""

    stage_class = TargetStage

    def __call__(self, tensors: Tensors) -> dict[str, torch.Tensor]:
        out = self.stage(  # type: ignore[operator]
            step_inputs_from_tensors(tensors),
            tensors["draft_tokens"],
            tensors["draft_probs"],
            tensors["num_verify"],
        )
        return {
            "output_ids": out.output_ids,
            "num_accepted": out.num_accepted,
            "target_ms": out.target_ms,
            **{name: getattr(out, name) for name in FEATURE_OUTPUTS},
        }


STAGE_ADAPTERS: dict[str, type[StageAdapter]] = {"draft": DraftAdapter, "target": TargetAdapter}


def stage_adapter(stage: str, params: StageParams, root: Path) -> StageAdapter:
    """The adapter of the model stage named `stage` ("draft" or "target")."""
    if stage not in STAGE_ADAPTERS:
        raise ValueError(f"stage must be one of {sorted(STAGE_ADAPTERS)}, got {stage!r}")
    return STAGE_ADAPTERS[stage](params, root)


@dataclass
class VerifierStepStats:
    """What one verifier step reports to the metrics."""

    batch_size: int
    drafted: int
    verified: int
    accepted: int
    trimmed: int
    budget_fraction: float | None  # None when no draft was a candidate
    refitted: bool
    stopped_early: int = 0  # drafts the plan did not draft (caps - num_drafted)
    draft_passes: int = 0  # draft positions of the deepest row
    draft_ms_saved: float = 0.0  # cost-table ms of the passes not run
    drafts_per_request: tuple[int, ...] = ()  # num_drafted of each row


class VerifierAdapter:
    """The adaptive verifier behind a Triton model, with warm start and per-step stats."""

    def __init__(self, config: EstimatorConfig, params: VerifierParams, root: Path) -> None:
        self.config = config
        self.snapshot = resolve_path(root, params.snapshot_path) if params.snapshot_path else None
        if params.cost_tables == HOST_COST_TABLES:
            logger.warning(
                "cost_tables 'host' is resolved by the launcher (avspec.serving.host.launcher with "
                "--draft-model and --target-model), which did not start this server: using "
                "linear defaults; measure them with make costs and name the file"
            )
        given = params.cost_tables
        costs = resolve_path(root, given) if is_path_value("cost_tables", given) else None
        cost = load_cost_tables(costs)
        self.refresh = CostRefresh(
            cost, params.cost_refresh, params.cost_refresh_window, params.cost_refresh_every
        )
        self.pair_id = params.pair_id
        self.estimator = load_estimator(config, self.snapshot, params.device, self.pair_id)
        self.verifier = AdaptiveVerifier(
            self.estimator, cost, refresh=self.refresh, drafting=params.adaptive_drafting
        )
        self.device = self.estimator.device
        log = resolve_path(root, params.step_log) if params.step_log else None
        self.step_log = StepLog(log) if log is not None else None

    def __call__(self, tensors: Tensors) -> tuple[dict[str, torch.Tensor], VerifierStepStats]:
        """One verifier step; num_verify [batch] int32 stays on the estimator's device.

        Features and the per-row vectors move to the estimator's device; seq ids, releases and
        the budget's base tokens are read on the host, where the scheduler builds them. The
        step itself does not sync the host (checked on a GPU by client/gpu_check.py); the
        metrics then read the step's counts with one copy (`step_stats`).
        """

        def on_device(name: str, dtype: torch.dtype) -> torch.Tensor:
            return tensors[name].to(device=self.device, dtype=dtype)

        prev_num_accepted = on_device("prev_num_accepted", torch.int32)
        num_drafted = on_device("num_drafted", torch.int32)
        refits = self.estimator.num_refits
        inputs = VerifierInputs(
            seq_ids=tensors["seq_ids"].cpu().long(),
            features=on_device("draft_features", torch.float32),
            num_draft_tokens=on_device("num_draft_tokens", torch.int32),
            adaptive=on_device("adaptive", torch.bool),
            prev_num_accepted=prev_num_accepted,
            release_seq_ids=tensors["release_seq_ids"].cpu().long(),
            base_tokens=base_tokens(tensors["input_lengths"].cpu(), tensors["reusable"].cpu()),
            num_drafted=num_drafted,
            adaptive_drafting=on_device("adaptive_drafting", torch.bool),
            prev_timing_ms=tensors["prev_timing_ms"].cpu().float(),
        )
        decision = self.verifier.step(inputs)
        if self.step_log is not None:
            self.step_log.append(inputs, decision.num_verify, int(decision.budget))
        refitted = self.estimator.num_refits != refits
        if refitted:
            self.save_snapshot()
        batch_size = int(tensors["seq_ids"].shape[0])
        stats = step_stats(decision, prev_num_accepted, batch_size, refitted, num_drafted)
        outputs = {
            "num_verify": decision.num_verify.to(torch.int32),
            "next_draft_plan": decision.draft_plan.float(),
        }
        return outputs, stats

    def coefficients(self) -> tuple[float, list[float]]:
        """Current (slope, intercepts), host copies for the gauges."""
        return float(self.estimator.slope), [float(b) for b in self.estimator.intercepts]

    def save_snapshot(self) -> None:
        """Write the warm-start snapshot (no-op without snapshot_path); failures are logged."""
        if self.snapshot is None:
            return
        try:
            self.snapshot.parent.mkdir(parents=True, exist_ok=True)
            save_snapshot(self.estimator, self.snapshot, self.pair_id)
        except (OSError, ValueError) as err:
            logger.warning("could not save estimator snapshot %s: %s", self.snapshot, err)


def step_stats(
    decision: VerifyDecision,
    prev_num_accepted: torch.Tensor,
    batch_size: int,
    refitted: bool,
    num_drafted: torch.Tensor | None = None,
) -> VerifierStepStats:
    """The step's metrics, its device scalars (and num_drafted [batch]) read with one copy.

    prev_num_accepted: [prev_batch] int32, on the estimator's device. One read per step, not
    one per value: on a GPU each read is a host sync.
    """
    accepted_sum = accepted_counts(prev_num_accepted)[0].long().sum()
    scalars = torch.stack(
        [
            decision.drafted, decision.verified, decision.budget, accepted_sum,
            decision.stopped_early, decision.draft_passes, decision.draft_ms_saved,
        ]
    ).double()  # fmt: skip
    per_row = num_drafted.double() if num_drafted is not None else scalars.new_zeros(0)
    values = torch.cat([scalars, per_row.to(scalars.device)]).tolist()
    drafted, verified, budget, accepted, stopped, passes = (int(v) for v in values[:6])
    return VerifierStepStats(
        batch_size=batch_size,
        drafted=drafted,
        verified=verified,
        accepted=accepted,
        trimmed=drafted - verified,
        budget_fraction=budget / drafted if drafted else None,
        refitted=refitted,
        stopped_early=stopped,
        draft_passes=passes,
        draft_ms_saved=values[6],
        drafts_per_request=tuple(int(v) for v in values[7:]),
    )
