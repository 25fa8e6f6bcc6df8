"""Triton-free helpers of the model repository's `model.py` adapters.

- One parameters dataclass per served model, parsed once in `initialize()` with
  `avspec.config.from_parameters` from the `parameters` block of its `config.pbtxt`.
- Relative paths in parameters resolve against the project root, the parent of the model
  repository directory (`model_repository/../models/draft` for `model_dir: "models/draft"`).
- Conversion of named torch tensors (or numpy arrays) to `StepInputs`, and of the step's
  tensors to and from numpy for the entry model's BLS call.
- `copy_repository`: a copy of the repository with parameter overrides and absolute
  paths, for tests and benchmarks that must not write next to the real one.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from avspec.config import EstimatorConfig, from_parameters
from avspec.contract import NUMPY_DTYPES, STEP_INPUTS, STEP_OUTPUTS, StepInputs, StepOutputs
from avspec.runtime.hf_files import GGUF_FILE
from avspec.serving import pbtxt

T = TypeVar("T")

# Parameters holding a path, resolved against the project root.
PATH_PARAMETERS = ("model_dir", "cost_tables", "snapshot_path", "step_log")
# The verifier's cost_tables that the launcher replaces by this host's measured file
# (avspec.serving.host.host_costs): a word, not a path.
HOST_COST_TABLES = "host"


def is_path_value(name: str, value: str) -> bool:
    """Whether parameter `name` = `value` names a file (resolved against the project root)."""
    if name == "cost_tables" and value == HOST_COST_TABLES:
        return False
    return name in PATH_PARAMETERS and bool(value)


# numpy dtypes of the step tensors, derived from the contract (avspec.contract.TensorSpec).
STEP_INPUT_DTYPES: dict[str, type] = {spec.name: spec.numpy_dtype for spec in STEP_INPUTS}
STEP_OUTPUT_DTYPES: dict[str, type] = {spec.name: spec.numpy_dtype for spec in STEP_OUTPUTS}
# torch dtype of each numpy dtype above.
TORCH_DTYPES: dict[type, torch.dtype] = {numpy: dtype for dtype, numpy in NUMPY_DTYPES.items()}


# Serving dtypes a stage may ask for, by device kind (fp16 matmuls are slow or missing on CPU;
# int8/int4/w8a8 run on torch's CPU kernels): avspec.runtime.precision says what each means.
# the stages' runtimes (StageParams.engine)
ENGINES = ("auto", "torch", "llamacpp")
SERVING_DTYPES: dict[str, tuple[str, ...]] = {
    "cpu": ("float32", "bfloat16", "auto", "int8", "int4", "w8a8"),
    "cuda": ("float32", "float16", "bfloat16", "auto"),
}


@dataclass(frozen=True)
class StageParams:
    """Parameters of the `draft` and `target` models."""

    model_dir: str
    max_draft_tokens: int = 8  # K; must equal the verifier's num_positions
    max_sequences: int = 64  # KV cache slots
    max_length: int = 512  # KV cache positions per sequence
    idle_timeout_s: float | None = None  # free a sequence not seen for this long (None: never)
    device: str = "cpu"
    malloc_trim_steps: int = 10  # give freed heap back to the OS every N steps (serving.heap)
    # this stage's glibc mmap threshold in MiB (serving.heap.set_mmap_threshold; 0: the
    # environment's, 1 MiB from the launcher)
    malloc_mmap_mib: int = 0
    dtype: str = "float32"  # serving dtype of weights and KV cache (SERVING_DTYPES by device)
    vocab_limit: int = 0  # the pair check's num_tokens: logits past it set to -inf (0: none)
    draft_top_k: int = 0  # draft only: sample drafts from the top k tokens within top-p (0: off)
    # draft only: a reduced draft vocabulary, the map file (avspec.engine.draft_vocab) relative
    # to model_dir or absolute ("": off, the whole vocabulary; "auto": model_dir's
    # draft_vocab.json when there is one, else off)
    draft_vocab: str = ""
    # the runtime: "torch" (avspec.runtime.transformer, the checkpoint in `dtype`), "llamacpp"
    # (llama.cpp's ggml on the CPU, avspec.runtime.llamacpp: the GGUF file `gguf`, relative to
    # model_dir or absolute, as it is quantized; `dtype` does not apply) or "auto" (by this
    # CPU and the files present: avspec.runtime.engine_choice)
    engine: str = "torch"
    gguf: str = GGUF_FILE
    threads: int = 0  # llama.cpp threads (0: every core); torch's come from OMP_NUM_THREADS
    kv_pool_tokens: int = 0  # KV cells shared by all sequences (0: sequences x length)
    flash_attention: bool = True  # llama.cpp: ggml's flash attention (off: 4-5x slower attention)
    # target only: also return the features a draft head reads (StepOutputs.target_features);
    # the launcher sets it when the draft model directory holds a head (avspec.runtime.head)
    emit_features: bool = False

    @property
    def pool_tokens(self) -> int:
        """The KV cells shared by the stage's sequences (`kv_pool_tokens`, else
        max_sequences x max_length: the cells a slot per sequence would reserve)."""
        return self.kv_pool_tokens or self.max_sequences * self.max_length

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine != "torch" and self.device != "cpu":
            raise ValueError(f"the llamacpp engine runs on the cpu, not {self.device!r}")
        if self.threads < 0 or self.kv_pool_tokens < 0:
            raise ValueError(
                f"threads and kv_pool_tokens must be >= 0, got {self.threads}, "
                f"{self.kv_pool_tokens}"
            )
        allowed = SERVING_DTYPES["cpu" if self.device == "cpu" else "cuda"]
        if self.dtype not in allowed:
            raise ValueError(
                f"dtype must be one of {', '.join(allowed)} on {self.device}, got {self.dtype!r}"
            )
        if self.vocab_limit < 0:
            raise ValueError(f"vocab_limit must be >= 0 (0: none), got {self.vocab_limit}")
        if self.draft_top_k < 0:
            raise ValueError(
                f"draft_top_k must be >= 0 (0: the target's warp), got {self.draft_top_k}"
            )
        if self.malloc_trim_steps < 0:
            raise ValueError(f"malloc_trim_steps must be >= 0, got {self.malloc_trim_steps}")
        if self.malloc_mmap_mib < 0:
            raise ValueError(
                f"malloc_mmap_mib must be >= 0 (0: the environment's), got {self.malloc_mmap_mib}"
            )
        for name in ("max_draft_tokens", "max_sequences", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class VerifierParams:
    """Parameters of the `verifier` model besides the EstimatorConfig fields."""

    # the step-cost file (avspec.av.cost_file); "host": this host's, measured and cached by the
    # launcher, which puts the file's path here; empty or missing: linear fallback, warned
    cost_tables: str = ""
    snapshot_path: str = ""  # warm start file; empty: no warm start
    device: str = "cpu"
    adaptive_drafting: bool = True  # hand the draft a plan (off: every row drafts its cap)
    cost_refresh: bool = True  # refresh the cost tables online from measured stage times
    cost_refresh_window: int = 64  # steps of measurements the refresh keeps
    cost_refresh_every: int = 16  # steps between refreshes
    pair_id: str = ""  # identity of the served draft/target pair (warm start); "": unknown
    step_log: str = ""  # JSON lines of every step's inputs and choice (avspec.av.step_log); "": off


@dataclass(frozen=True)
class EntryParams:
    """Parameters of the `speculative` entry model."""

    max_batch_size: int = 64  # live sequences stepped together
    max_context: int = 448  # prompt + generated tokens per sequence
    max_draft_tokens: int = 8  # K, the largest num_draft_tokens a request may ask for
    adaptive_verification: bool = True  # default when a request does not say
    adaptive_drafting: bool = True  # default when a request does not say (needs AV on)
    step_model: str = "speculative_step"  # the ensemble called once per decode step
    max_queued: int | None = 256  # waiting requests beyond free batch slots (None: unbounded)
    max_queued_per_client: int | None = 64  # the same for one client
    refit_max_temperature: float = 2.0  # outcomes of hotter requests do not feed the refit
    refit_client_share: float = 0.25  # one client labels <= max(1, floor(s n)) of n rows a step
    request_timeout_s: float = 600.0  # wall-clock limit per request from submission (0: none)
    prefill_chunk: int = 128  # prompt tokens a sequence sends per step while prefilling (0: all)

    def __post_init__(self) -> None:
        for name in ("max_batch_size", "max_context", "max_draft_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.prefill_chunk and self.prefill_chunk < 2 + self.max_draft_tokens:
            raise ValueError(
                f"prefill_chunk must be 0 or >= max_draft_tokens + 2 = "
                f"{2 + self.max_draft_tokens}, got {self.prefill_chunk}"
            )
        for name in ("max_queued", "max_queued_per_client"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 or none, got {getattr(self, name)}")
        if not self.refit_max_temperature >= 0:
            raise ValueError(
                f"refit_max_temperature must be >= 0, got {self.refit_max_temperature}"
            )
        if not 0 < self.refit_client_share <= 1:
            raise ValueError(
                f"refit_client_share must lie in (0, 1], got {self.refit_client_share}"
            )
        if not 0 <= self.request_timeout_s < float("inf"):
            raise ValueError(
                f"request_timeout_s must be >= 0 and finite (0: no limit), "
                f"got {self.request_timeout_s}"
            )


@dataclass(frozen=True)
class TrtllmTargetParams:
    """Parameters of the `trtllm_target` model (GPU repository; its adapter:
    avspec.serving.stages.gpu_adapters)."""

    vocab_size: int  # the engine's vocabulary (draft_logits width); the draft's must not exceed it
    trtllm_model: str = "tensorrt_llm"  # the tensorrtllm-backend model called per sequence
    max_draft_tokens: int = 8  # K: the contract's output width is K + 1; <= engine max_draft_len
    max_sequences: int = 128  # live sequences whose context is kept
    max_length: int = 4096  # committed tokens per sequence
    use_draft_logits: bool = True  # send draft_logits (probabilistic acceptance) when sampling

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_draft_tokens", "max_sequences", "max_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


def model_parameters(model_config: str | Mapping[str, Any]) -> dict[str, Any]:
    """Return the `parameters` block of a model config (JSON text or dict from Triton)."""
    config = json.loads(model_config) if isinstance(model_config, str) else model_config
    return dict(config.get("parameters", {}))


def parse_verifier_parameters(
    params: Mapping[str, Any],
) -> tuple[EstimatorConfig, VerifierParams]:
    """Split the verifier's parameters into the EstimatorConfig and the serving fields."""
    estimator_fields = {f.name for f in dataclasses.fields(EstimatorConfig)}
    serving_fields = {f.name for f in dataclasses.fields(VerifierParams)}
    estimator = from_parameters(EstimatorConfig, params, ignore=serving_fields)
    serving = from_parameters(VerifierParams, params, ignore=estimator_fields)
    return estimator, serving


def parse_parameters(cls: type[T], params: Mapping[str, Any]) -> T:
    """`from_parameters` for the serving dataclasses (kept as one import for the adapters)."""
    return from_parameters(cls, params)


def project_root(model_directory: str | Path) -> Path:
    """Return the project root for Triton's `args["model_repository"]` (the model's directory).

    The model directory is `<root>/model_repository/<model>`, so the root is two levels up.
    """
    return Path(model_directory).resolve().parent.parent


def resolve_path(root: Path, value: str) -> Path:
    """Resolve a path parameter: absolute as given, relative against the project root."""
    path = Path(value).expanduser()
    return path if path.is_absolute() else (root / path)


def step_inputs_from_tensors(tensors: Mapping[str, torch.Tensor]) -> StepInputs:
    """StepInputs from torch tensors named like its fields: dtypes as declared, devices kept.

    The one input converter of the stage adapters, CPU and GPU alike (a CPU model's tensors are
    numpy views, a GPU model's may live on the device).
    """
    missing = sorted(set(STEP_INPUT_DTYPES) - set(tensors))
    if missing:
        raise ValueError(f"missing step input(s): {', '.join(missing)}")
    return StepInputs(**{spec.name: tensors[spec.name].to(spec.dtype) for spec in STEP_INPUTS})


def step_inputs_to_numpy(inputs: StepInputs) -> dict[str, np.ndarray]:
    """Return the StepInputs fields as numpy arrays of the declared dtypes (CPU copies)."""
    return {
        name: getattr(inputs, name).detach().cpu().numpy().astype(dtype, copy=False)
        for name, dtype in STEP_INPUT_DTYPES.items()
    }


def step_outputs_from_numpy(arrays: Mapping[str, np.ndarray]) -> StepOutputs:
    """Build StepOutputs from the ensemble's numpy outputs.

    output_ids, num_accepted and num_verify are required (KeyError); the stale state and timing
    outputs (next_draft_plan, draft_ms, target_ms, num_drafted) default to empty when absent.
    """
    required = ("output_ids", "num_accepted", "num_verify")
    missing = [name for name in required if name not in arrays]
    if missing:
        raise KeyError(f"step outputs lack {', '.join(missing)}")
    return StepOutputs(
        **{
            name: torch.from_numpy(np.ascontiguousarray(arrays[name], dtype=dtype))
            for name, dtype in STEP_OUTPUT_DTYPES.items()
            if name in arrays
        }
    )


def read_config_parameters(config_text: str) -> dict[str, str]:
    """Return {key: string_value} of the `parameters` entries of a config.pbtxt text."""
    return pbtxt.parameters(pbtxt.parse(config_text))


def rewrite_config_parameters(
    config_text: str, overrides: Mapping[str, str], root: Path | None = None
) -> str:
    """Replace parameter values in a config.pbtxt text (parsed as a Triton ModelConfig; the
    leading comment lines are kept, the others dropped).

    Every key of `overrides` must already be a parameter (ValueError otherwise: a typo must not
    pass silently). With `root`, relative PATH_PARAMETERS become absolute against it.
    """
    config = pbtxt.parse(config_text)
    current = pbtxt.parameters(config)
    unknown = sorted(set(overrides) - set(current))
    if unknown:
        raise ValueError(f"no such parameter(s) to override: {', '.join(unknown)}")
    values = {key: str(overrides.get(key, value)) for key, value in current.items()}
    if root is not None:
        values = {
            key: str(resolve_path(root, value)) if is_path_value(key, value) else value
            for key, value in values.items()
        }
    pbtxt.set_parameters(config, values)
    header = list(itertools.takewhile(lambda line: line.startswith("#"), config_text.splitlines()))
    return pbtxt.render(config, [line.removeprefix("#").removeprefix(" ") for line in header])


def copy_repository(
    source: str | Path,
    destination: str | Path,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """Copy the model repository `source` to `destination` with parameter overrides.

    overrides: {model name: {parameter: value}}. Relative path parameters become absolute
    against the source's project root, so the copy works from anywhere.
    """
    source, destination = Path(source).resolve(), Path(destination)
    overrides = dict(overrides or {})
    unknown = sorted(m for m in overrides if not (source / m / "config.pbtxt").is_file())
    if unknown:
        raise ValueError(f"no such model(s) in {source}: {', '.join(unknown)}")
    shutil.copytree(source, destination, ignore=shutil.ignore_patterns("__pycache__"))
    # configs/<name>.pbtxt (the GPU variants, `--model-config-name`) get the same overrides
    configs = [*destination.glob("*/config.pbtxt"), *destination.glob("*/configs/*.pbtxt")]
    for config in configs:
        model = config.parent.name if config.name == "config.pbtxt" else config.parent.parent.name
        model_overrides = {k: str(v) for k, v in overrides.get(model, {}).items()}
        text = config.read_text()
        try:
            config.write_text(rewrite_config_parameters(text, model_overrides, source.parent))
        except ValueError as err:
            raise ValueError(f"{config.relative_to(destination)}: {err}") from None
    return destination


TARGET_MODEL = "target"  # the repository's target model, whose model_dir holds the tokenizer


def served_tokenizer_dir(model_directory: str | Path) -> Path | None:
    """`target_model_dir`, or None for a repository without a target model that names its
    `model_dir` (a repository of test models): the front then serves no OpenAI completions."""
    try:
        return target_model_dir(model_directory)
    except ValueError:
        return None


def target_model_dir(model_directory: str | Path) -> Path:
    """The target model's `model_dir` parameter for the entry model in `model_directory`
    (the sibling `target/config.pbtxt`, relative paths against the project root): the
    directory whose tokenizer the entry serves with. ValueError naming what is missing."""
    config = Path(model_directory).parent / TARGET_MODEL / "config.pbtxt"
    if not config.is_file():
        raise ValueError(f"{config} not found: the entry model serves the target's tokenizer")
    model_dir = read_config_parameters(config.read_text()).get("model_dir", "")
    if not model_dir:
        raise ValueError(f"{config}: no model_dir parameter, so no tokenizer to serve with")
    return resolve_path(project_root(model_directory), model_dir)
