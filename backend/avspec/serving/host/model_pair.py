"""The launcher's look at the draft/target pair before tritonserver starts (`make serve`).

`prepare_pair` reads both models' tokenizers and configs (Hugging Face checkpoints, the only
model format: `avspec.runtime.model_dir`), runs the pair check
(`avspec.runtime.pair.check_pair`) and works out the parameter overrides the served repository
copy gets: the two `model_dir`s, `vocab_limit` (the pair's real token count, so padded embedding
rows are masked), the stages' `max_length` and the entry's `max_context` capped at the models'
`max_position_embeddings`, and the verifier's `pair_id` (`pair_identity`, recorded in the
warm-start snapshot). No weight is read: a pair that cannot be served fails here, with the pair
check's one message, before any model loads. `PreparedPair.lines` are what the launcher prints,
one per model and one per cap.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch

from avspec.runtime.engine_choice import choose_engine
from avspec.runtime.hf_checkpoint import read_hf_config
from avspec.runtime.hf_files import GGUF_FILE
from avspec.runtime.hf_tokenizer import TOKENIZER_FILE
from avspec.runtime.model_dir import CONFIG_FILE, check_model_dir, load_tokenizer
from avspec.runtime.pair import PairInfo, check_pair
from avspec.runtime.precision import resolve_precision
from avspec.runtime.transformer import Transformer, TransformerConfig
from avspec.serving.repository import (
    EntryParams,
    StageParams,
    parse_parameters,
    read_config_parameters,
    resolve_path,
)

STAGES = ("draft", "target")
ENTRY = "speculative"
VERIFIER = "verifier"
# Files whose bytes make a model directory's identity for the warm start (when present).
IDENTITY_FILES = (CONFIG_FILE, TOKENIZER_FILE)


@dataclass(frozen=True)
class ModelSummary:
    """One model of the pair as the launcher reports it (read from its config, no weights)."""

    role: str
    directory: Path
    architecture: str
    dtype: str
    num_parameters: int
    max_position_embeddings: int
    kv_bytes_per_token: int
    kv_values_per_token: int
    max_sequences: int
    max_length: int

    @property
    def kv_cache_bytes(self) -> int:
        """The KV cache this stage reserves: max_sequences x max_length x kv_bytes_per_token."""
        return self.max_sequences * self.max_length * self.kv_bytes_per_token

    def line(self) -> str:
        return (
            f"avspec: {self.role} {self.directory}: {self.architecture}, {self.dtype}, "
            f"{self.num_parameters:,} parameters, KV cache {_mib(self.kv_cache_bytes)} "
            f"({self.max_sequences} sequences x {self.max_length} tokens x "
            f"{self.kv_bytes_per_token} bytes)"
        )


@dataclass(frozen=True)
class PreparedPair:
    """A checked pair, its summaries and the overrides {model: {parameter: value}}."""

    draft: ModelSummary
    target: ModelSummary
    info: PairInfo
    identity: str
    overrides: dict[str, dict[str, str]]
    caps: list[str] = field(default_factory=list)

    @property
    def lines(self) -> list[str]:
        return [self.draft.line(), self.target.line(), *self.caps]


def pair_identity(draft_dir: Path | str, target_dir: Path | str) -> str:
    """A short identity of the pair: sha256 over the draft's then the target's config.json and
    tokenizer.json contents (a missing file counts as empty), first 16 hex digits."""
    digest = hashlib.sha256()
    for directory in (Path(draft_dir), Path(target_dir)):
        for name in IDENTITY_FILES:
            path = directory / name
            data = path.read_bytes() if path.is_file() else b""
            digest.update(f"{name}:{len(data)}:".encode())
            digest.update(data)
    return digest.hexdigest()[:16]


def prepare_pair(
    repository: Path | str,
    draft_dir: Path | str | None = None,
    target_dir: Path | str | None = None,
) -> PreparedPair:
    """Check the pair the repository would serve, with `draft_dir` / `target_dir` overriding
    the stages' `model_dir` (relative paths against the repository's project root).

    Raises PairError (the pair check's message, naming both directories) for a pair that
    cannot be served, and ValueError for an unreadable config or parameter.
    """
    repository = Path(repository).resolve()
    root = repository.parent
    params = {m: _parameters(repository, m) for m in (*STAGES, ENTRY)}
    chosen = {"draft": draft_dir, "target": target_dir}
    stages: dict[str, StageParams] = {}
    for role in STAGES:
        values = dict(params[role])
        if chosen[role] is not None:
            values["model_dir"] = str(chosen[role])
        stages[role] = parse_parameters(StageParams, values)
    dirs = {role: resolve_path(root, stages[role].model_dir).resolve() for role in STAGES}
    for role in STAGES:  # a directory that is not a Hugging Face checkpoint: refused by name
        check_model_dir(dirs[role])
    tokenizers = {role: load_tokenizer(dirs[role]) for role in STAGES}
    configs = {role: _read_config(dirs[role]) for role in STAGES}
    info = check_pair(
        dirs["draft"], dirs["target"], tokenizers["draft"], tokenizers["target"],
        configs["draft"][1].vocab_size, configs["target"][1].vocab_size,
    )  # fmt: skip

    ceiling = min(max_positions for _, _, max_positions in configs.values())
    entry = parse_parameters(EntryParams, params[ENTRY])
    caps = []
    if entry.max_context > ceiling:
        caps.append(
            f"avspec: max_context {entry.max_context} capped at {ceiling} "
            f"(max_position_embeddings)"
        )
    overrides: dict[str, dict[str, str]] = {
        ENTRY: {"max_context": str(min(entry.max_context, ceiling))}
    }
    summaries = {}
    for role in STAGES:
        stage = stages[role]
        max_length = min(stage.max_length, ceiling)
        if stage.max_length > ceiling:
            caps.append(
                f"avspec: {role} max_length {stage.max_length} capped at {ceiling} "
                f"(max_position_embeddings)"
            )
        architecture, config, max_positions = configs[role]
        summaries[role] = _summary(
            role, dirs[role], architecture, config, max_positions, stage, max_length
        )
        overrides[role] = {
            "model_dir": str(dirs[role]),
            "max_length": str(max_length),
            "vocab_limit": str(info.num_tokens),
        }
    identity = pair_identity(dirs["draft"], dirs["target"])
    if "pair_id" in _parameters(repository, VERIFIER):
        overrides[VERIFIER] = {"pair_id": identity}
    return PreparedPair(summaries["draft"], summaries["target"], info, identity, overrides, caps)


def served_parameters(
    repository: Path | str, model: str, overrides: dict[str, dict[str, object]]
) -> dict[str, str]:
    """Model `model`'s parameters as served: the repository's config with `overrides` on top."""
    values = _parameters(Path(repository), model)
    return {**values, **{k: str(v) for k, v in overrides.get(model, {}).items()}}


def stage_parameters(
    repository: Path | str, role: str, overrides: dict[str, dict[str, object]]
) -> StageParams:
    """Stage `role`'s StageParams as served (`served_parameters`, parsed)."""
    return parse_parameters(StageParams, served_parameters(repository, role, overrides))


def _parameters(repository: Path, model: str) -> dict[str, str]:
    config = repository / model / "config.pbtxt"
    if not config.is_file():
        raise ValueError(f"{repository} has no {model}/config.pbtxt: cannot check the pair")
    return read_config_parameters(config.read_text())


def _read_config(directory: Path) -> tuple[str, TransformerConfig, int]:
    """(architecture, model config, max_position_embeddings) of a Hugging Face checkpoint."""
    spec = read_hf_config(directory)
    return spec.architecture, spec.config, spec.max_position_embeddings


def _summary(
    role: str,
    directory: Path,
    architecture: str,
    config: TransformerConfig,
    max_positions: int,
    stage: StageParams,
    max_length: int,
) -> ModelSummary:
    with torch.device("meta"):  # shapes only: nothing allocated or initialised
        num_parameters = Transformer(config).num_parameters()
    precision = resolve_precision(stage.dtype, stage.device)
    return ModelSummary(
        role=role,
        directory=directory,
        architecture=architecture,
        dtype=str(precision),
        num_parameters=num_parameters,
        max_position_embeddings=max_positions,
        kv_bytes_per_token=config.kv_values_per_token * precision.dtype.itemsize,
        kv_values_per_token=config.kv_values_per_token,
        max_sequences=stage.max_sequences,
        max_length=max_length,
    )


def _mib(size: int) -> str:
    return f"{size / 2**20:.1f} MiB"


def shared_pool_overrides(
    repository: Path | str, pair: PreparedPair, overrides: dict[str, dict[str, object]]
) -> list[str]:
    """Serve the pair's own context on either engine: each stage's `max_length` and the entry's
    `max_context` become the models' `max_position_embeddings`, and the KV cells the stage
    reserved before (`kv_pool_tokens`, else max_sequences x max_length) become one pool shared
    by every sequence. Updates `overrides` in place; returns the lines to print."""
    repository = Path(repository)
    stages = {role: stage_parameters(repository, role, overrides) for role in STAGES}
    context = min(pair.draft.max_position_embeddings, pair.target.max_position_embeddings)
    lines = []
    for role, stage in stages.items():
        pool = stage.pool_tokens
        summary = pair.draft if role == "draft" else pair.target
        overrides.setdefault(role, {}).update(max_length=str(context), kv_pool_tokens=str(pool))
        if stage.engine == "llamacpp":
            where, size = "llama.cpp", f"{_mib(pool * summary.kv_values_per_token * 2)} of f16"
        else:
            where, size = "torch", f"{_mib(pool * summary.kv_bytes_per_token)} of {stage.dtype}"
        lines.append(
            f"avspec: {role} on {where}: one KV pool of {pool:,} cells shared by up to "
            f"{stage.max_sequences} sequences of up to {context:,} positions "
            f"({size} keys and values)"
        )
    overrides.setdefault(ENTRY, {})["max_context"] = str(context)
    return lines


def resolve_auto_engine(
    repository: Path | str, pair: PreparedPair, overrides: dict[str, dict[str, object]]
) -> list[str]:
    """Replace an `engine: auto` of either stage (in `overrides`, else the repository's) by
    `avspec.runtime.engine_choice`'s choice for both, made once on the pair's GGUF files;
    returns the line to print (none when no stage says auto)."""
    wanted = {role: served_parameters(repository, role, overrides).get("engine")
              for role in STAGES}  # fmt: skip
    if "auto" not in wanted.values():
        return []
    gguf = served_parameters(repository, "target", overrides).get("gguf", GGUF_FILE)
    files = {"draft": pair.draft.directory / GGUF_FILE, "target": pair.target.directory / gguf}
    engine, why = choose_engine([files[role] for role in STAGES if wanted[role] == "auto"])
    for role in STAGES:
        if wanted[role] == "auto":
            overrides.setdefault(role, {})["engine"] = engine
    return [f"avspec: engine {engine} ({why})"]


def check_target_gguf(repository: Path | str, overrides: dict[str, dict[str, object]]) -> None:
    """A target GGUF other than model.gguf (a requantized file) is llama.cpp's engine's only:
    raise ValueError naming both when the target's resolved engine is another."""
    target = stage_parameters(repository, "target", overrides)
    if target.gguf != GGUF_FILE and target.engine != "llamacpp":
        raise ValueError(
            f"the target's GGUF {target.gguf!r} is served by llama.cpp's engine only, and the "
            f"target runs {target.engine!r}: add --engine llamacpp (make serve ENGINE=llamacpp)"
        )
