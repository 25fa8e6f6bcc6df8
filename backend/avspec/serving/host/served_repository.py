"""The repository served: a user's pair checked and described, and a rewritten copy.

`--draft-model DIR --target-model DIR` (`make serve DRAFT_MODEL=... TARGET_MODEL=...`) serve a
user's pair: before tritonserver starts, the pair is checked from configs and tokenizers only
(avspec.serving.host.model_pair; a mismatch exits 1 with the pair check's message), one line per
model is printed (path, architecture, dtype, parameters, KV cache reserved), and a copy of the
repository with the pair's overrides (model_dir, vocab_limit, capped max_length / max_context,
the verifier's pair_id), the stages' settings and this host's cost tables
(avspec.serving.host.host_costs) is served from a temporary directory.
"""

from __future__ import annotations

from pathlib import Path

from avspec.runtime.head import is_head_dir
from avspec.serving.host.host_costs import CostOptions, resolve_host_costs
from avspec.serving.host.model_pair import (
    check_target_gguf,
    prepare_pair,
    resolve_auto_engine,
    shared_pool_overrides,
)
from avspec.serving.host.settings import ServeSettings
from avspec.serving.repository import copy_repository


def prepare_repository(
    repository: Path,
    draft_model: Path | None,
    target_model: Path | None,
    workdir: Path,
    settings: dict[str, dict[str, str]] | None = None,
    costs: CostOptions | None = None,
) -> Path:
    """Check the pair (`avspec.serving.host.model_pair.prepare_pair`) when one is given, print its
    lines and return a copy of `repository` under `workdir` with the pair's overrides and the
    stages' `settings` ({"target": {"dtype": "w8a8", "engine": "torch"}, ...}), the verifier's
    cost tables of this host resolved with `costs` (avspec.serving.host.host_costs; measured first
    when not cached). Raises PairError (a ValueError, the pair check's one message) before
    anything is copied or loaded."""
    overrides: dict[str, dict[str, object]] = {}
    if draft_model is not None or target_model is not None:
        pair = prepare_pair(
            repository,
            draft_model.resolve() if draft_model is not None else None,
            target_model.resolve() if target_model is not None else None,
        )
        for line in pair.lines:
            print(line, flush=True)
        overrides = {stage: dict(values) for stage, values in pair.overrides.items()}
    for stage, values in (settings or {}).items():
        for name, value in values.items():
            overrides.setdefault(stage, {})[name] = value
            print(f"avspec: {stage} stage {name} {value}", flush=True)
    if draft_model is not None or target_model is not None:
        if is_head_dir(pair.draft.directory):
            print(head_overrides(overrides), flush=True)
        for line in [*resolve_auto_engine(repository, pair, overrides),
                     *shared_pool_overrides(repository, pair, overrides)]:  # fmt: skip
            print(line, flush=True)
        check_target_gguf(repository, overrides)
        for line in resolve_host_costs(repository, pair, overrides, costs or CostOptions()):
            print(line, flush=True)
    return copy_repository(repository, workdir / repository.name, overrides)


def head_overrides(overrides: dict[str, dict[str, object]]) -> str:
    """A draft head (avspec.runtime.head) runs on the torch runtime and reads the target's
    features: the draft stage on torch whatever engine was asked for (an engine setting names
    the target's then), the target emitting its features on its own engine (torch, or llama.cpp's
    embeddings output). Updates `overrides`; returns the line to print."""
    overrides.setdefault("draft", {})["engine"] = "torch"
    overrides.setdefault("target", {})["emit_features"] = "true"
    return "avspec: draft head: the head on torch, the target emits its features"


def served_settings(settings: ServeSettings, workdir: Path) -> ServeSettings:
    """`settings` as served: with a prepared copy of the first repository under `workdir` when
    a pair or a stage setting is given, else as they are. ValueError for `--costs-only`
    without a pair."""
    stages = settings.stage_settings()
    pair = settings.pair
    if pair.given or stages:
        copy = prepare_repository(
            settings.models.repositories[0],
            pair.draft_model,
            pair.target_model,
            workdir,
            stages,
            settings.costs.options(settings.server.cpu_threads),
        )
        settings = settings.serving(copy)
    if settings.costs.only and not pair.given:
        raise ValueError("--costs-only needs --draft-model and --target-model")
    return settings
