"""Load a Hugging Face Llama-family checkpoint directory into the project's `Transformer`.

A directory holds `config.json`, the weights as `model.safetensors` or as shards listed in
`model.safetensors.index.json` (its `weight_map`), and optionally `generation_config.json`
(tokenizer files are read elsewhere). Architectures: `LlamaForCausalLM` (grouped-query
attention, `head_dim`, `tie_word_embeddings`, `attention_bias` on q/k/v/o, `mlp_bias`,
`rms_norm_eps`, `rope_theta`, `rope_scaling` of type `linear` or `llama3`),
`Qwen2ForCausalLM` (bias on q/k/v, none on o) and `MistralForCausalLM` (only while the
context asked for fits in its `sliding_window`). RoPE settings are read in both forms: the
older top-level `rope_theta` + `rope_scaling`, and the newer `rope_parameters` object.

Mapping onto the runtime (`avspec.runtime.transformer`): q/k/v projections become the rows of
one fused `qkv` (q, k, v in that order), gate/up become the rows of `mlp_in` (gate, up),
o/down are `attn_out`/`mlp_out`; the half-split ("rotate_half") RoPE layout of these models is
the runtime's `rope_style="half"`.

Loading checks everything before allocating the model: every config field it uses, every
tensor's presence, shape and stored dtype (F32, F16 or BF16), the files opened with
safetensors' `safe_open`. Any problem raises `HFCheckpointError` (a ValueError) naming the
file and the field or tensor, so a caller never holds a half-loaded model. Weights are then
read memory-mapped one tensor at a time and copied, converted, into the model built
uninitialised in the serving dtype, each tensor's pages released once copied
(`_MappedWeights`): no second copy of the model is ever resident.

`save_hf_model` is the inverse for a `Transformer` in Llama form (SwiGLU MLP, RMSNorm with an
explicit epsilon, half-split RoPE, one bias flag for q/k/v/o): it writes a `LlamaForCausalLM`
directory (`config.json`, `model.safetensors` under the Hugging Face tensor names,
`generation_config.json`, and the tokenizer files when given) that both `load_hf_model` and
`transformers` load to the same logits. `check_llama_form` names the first config field Llama
cannot express exactly.
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from avspec.runtime.hf_tokenizer import HFTokenizer
from avspec.runtime.json_file import read_json_object
from avspec.runtime.rope import RopeScaling
from avspec.runtime.transformer import Transformer, TransformerConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SERVING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}
ROPE_TYPES = ("default", "linear", "llama3")
DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig and Qwen2Config default, when config.json omits it
QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's default
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved
_REQUIRED: Any = object()  # a _Fields default: the field must be present


class HFCheckpointError(ValueError):
    """A Hugging Face model directory is missing a file, or holds an unsupported config/weight."""


@dataclass(frozen=True)
class HFConfig:
    """What `config.json` (and `generation_config.json`) say, before any weight is read."""

    directory: Path
    architecture: str
    config: TransformerConfig
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int


@dataclass(frozen=True)
class HFModelInfo:
    """A loaded model's description: for the launcher's log line and the pair check.

    `kv_bytes_per_token` is what one token of one sequence slot costs in the KV cache (keys
    and values of every layer in the serving dtype); on the CPU the cache reserves as much
    again for its read workspaces (`avspec.runtime.kv_cache`).
    """

    directory: Path
    architecture: str
    dtype: torch.dtype
    checkpoint_dtypes: tuple[str, ...]
    num_parameters: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    max_position_embeddings: int
    max_length: int
    kv_bytes_per_token: int
    config: TransformerConfig


def load_hf_model(
    directory: Path | str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_length: int | None = None,
) -> tuple[Transformer, HFModelInfo]:
    """Load a checkpoint directory as a `Transformer` in eval mode, weights in `dtype` on `device`.

    `max_length` is the context the caller will serve (the rotary table and KV cache bound);
    default and ceiling: the config's `max_position_embeddings`. Raises HFCheckpointError on
    any problem, before the model is allocated.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"serving dtype must be one of {SERVING_DTYPES}, got {dtype}")
    spec = read_hf_config(directory, max_length)
    plan = _weight_plan(spec.config)
    weights_file, files = _weight_files(spec.directory)
    with ExitStack() as stack:
        handles = {path: stack.enter_context(_open(path)) for path in sorted(set(files.values()))}
        stored = _check_weights(weights_file, files, handles, plan, spec.config)
        model = Transformer.empty(spec.config, device=device, dtype=dtype)
        _copy_weights(model, files, handles, plan)
    model.eval()
    info = HFModelInfo(
        directory=spec.directory,
        architecture=spec.architecture,
        dtype=dtype,
        checkpoint_dtypes=stored,
        num_parameters=model.num_parameters(),
        vocab_size=spec.config.vocab_size,
        bos_token_id=spec.bos_token_id,
        eos_token_ids=spec.eos_token_ids,
        max_position_embeddings=spec.max_position_embeddings,
        max_length=spec.config.max_length,
        kv_bytes_per_token=spec.config.kv_values_per_token * dtype.itemsize,
        config=spec.config,
    )
    return model, info


def read_hf_config(directory: Path | str, max_length: int | None = None) -> HFConfig:
    """Parse and check `config.json` (+ `generation_config.json`); see `load_hf_model`."""
    if max_length is not None and (
        not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1
    ):
        raise ValueError(f"max_length must be a positive int or None, got {max_length!r}")
    directory = Path(directory)
    if not directory.is_dir():
        raise HFCheckpointError(f"model directory {directory} does not exist")
    config_path = directory / CONFIG_FILE
    f = _Fields(config_path, _read_json(config_path))
    architectures = f.get("architectures")
    if (
        not isinstance(architectures, list)
        or len(architectures) != 1
        or architectures[0] not in ARCHITECTURES
    ):
        raise f.error("architectures", f"is {architectures!r}; supported: one of {ARCHITECTURES}")
    architecture = architectures[0]
    if f.get("quantization_config") is not None:
        raise f.error("quantization_config", "is set: quantized checkpoints are not supported")
    if f.get("hidden_act", "silu") != "silu":
        raise f.error("hidden_act", f"is {f.get('hidden_act')!r}; supported: 'silu'")
    width, num_heads = f.integer("hidden_size"), f.integer("num_attention_heads")
    kv_default = num_heads if architecture == "LlamaForCausalLM" else _REQUIRED
    num_kv_heads = f.integer("num_key_value_heads", kv_default)
    if num_heads % num_kv_heads:
        raise f.error(
            "num_key_value_heads",
            f"is {num_kv_heads}: num_attention_heads {num_heads} is not a multiple of it",
        )
    head_dim = f.integer("head_dim", None)
    if head_dim is None:
        if width % num_heads:
            message = f"is missing and hidden_size {width} is not a multiple of {num_heads} heads"
            raise f.error("head_dim", message)
        head_dim = width // num_heads
    if head_dim % 2:
        raise f.error("head_dim", f"is {head_dim}: rotary embeddings need an even head_dim")
    max_positions = f.integer("max_position_embeddings")
    if max_length is None:
        max_length = max_positions
    elif max_length > max_positions:
        raise f.error(
            "max_position_embeddings",
            f"is {max_positions}: the requested context of {max_length} tokens is past it",
        )
    _check_sliding_window(f, architecture, max_length)
    theta, scaling = _rope(f)
    llama = architecture == "LlamaForCausalLM"
    attention_bias = f.flag("attention_bias", False) if llama else False
    qwen2 = architecture == "Qwen2ForCausalLM"
    try:
        config = TransformerConfig(
            num_layers=f.integer("num_hidden_layers"),
            width=width,
            num_heads=num_heads,
            vocab_size=f.integer("vocab_size"),
            max_length=max_length,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            intermediate_size=f.integer("intermediate_size"),
            mlp="swiglu",
            norm_eps=f.number("rms_norm_eps", 1e-6),
            qkv_bias=attention_bias or qwen2,
            out_bias=attention_bias,
            mlp_bias=f.flag("mlp_bias", False) if llama else False,
            tie_embeddings=f.flag("tie_word_embeddings", False),
            rope_theta=theta,
            rope_style="half",
            rope_scaling=scaling,
        )
    except ValueError as err:
        raise HFCheckpointError(f"{config_path}: unsupported model shape: {err}") from None
    bos, eos = _special_tokens(directory, f, config.vocab_size)
    return HFConfig(directory, architecture, config, bos, eos, max_positions)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def check_llama_form(config: TransformerConfig) -> None:
    """Raise ValueError naming the first `TransformerConfig` field `LlamaForCausalLM` cannot
    express exactly; return None for a Llama-form config."""
    problems = {
        "mlp": (config.mlp != "swiglu", "Llama's MLP is SwiGLU ('swiglu')"),
        "rope_style": (
            config.rope_style != "half",
            "Llama rotates channel pairs (i, i + head_dim/2) ('half')",
        ),
        "norm_eps": (config.norm_eps is None, "Llama's RMSNorm needs an explicit epsilon"),
        "out_bias": (
            config.out_bias != config.qkv_bias,
            f"Llama's attention_bias sets q/k/v and o biases together (qkv_bias is "
            f"{config.qkv_bias})",
        ),
    }
    for field, (bad, why) in problems.items():
        if bad:
            value = getattr(config, field)
            raise ValueError(
                f"TransformerConfig.{field} is {value!r}: LlamaForCausalLM cannot express it; "
                f"{why}"
            )


def llama_config_json(
    config: TransformerConfig,
    bos_token_id: int | None,
    eos_token_ids: Sequence[int],
    dtype: torch.dtype = torch.float32,
) -> dict[str, Any]:
    """The `config.json` of a Llama-form `config` (checked by `check_llama_form`)."""
    check_llama_form(config)
    scaling = config.rope_scaling
    rope_scaling = None
    if scaling is not None:
        rope_scaling = {"rope_type": scaling.kind, "factor": scaling.factor}
        if scaling.kind == "llama3":
            for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                rope_scaling[key] = getattr(scaling, key)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.width,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": config.qkv_bias,
        "attention_dropout": 0.0,
        "mlp_bias": config.mlp_bias,
        "tie_word_embeddings": config.tie_embeddings,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_length,
        "bos_token_id": bos_token_id,
        "eos_token_id": _one_or_list(eos_token_ids),
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


def save_hf_model(
    model: Transformer,
    directory: Path | str,
    tokenizer_dir: Path | str | None = None,
    *,
    eos_token_id: int | Sequence[int] | None = None,
    bos_token_id: int | None = None,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write `model` as a `LlamaForCausalLM` directory; returns the directory.

    EOS and BOS default to what the tokenizer files of `tokenizer_dir` name (those files are
    copied alongside); EOS must come from one of the two. `max_position_embeddings` is the
    model's `max_length`; weights are stored in `dtype`. ValueError, before anything is
    written, for a config Llama cannot express (`check_llama_form`), a tokenizer larger than
    the embedding, or a directory already holding a sharded checkpoint.
    """
    if dtype not in SERVING_DTYPES:
        raise ValueError(f"dtype must be one of {SERVING_DTYPES}, got {dtype}")
    directory = Path(directory)
    tokenizer = HFTokenizer.from_directory(tokenizer_dir) if tokenizer_dir is not None else None
    eos, bos = _save_special_ids(model.config, tokenizer, eos_token_id, bos_token_id)
    config_json = llama_config_json(model.config, bos, eos, dtype)
    if (directory / INDEX_FILE).exists():
        raise ValueError(f"{directory} holds a sharded checkpoint ({INDEX_FILE}); use a new one")
    directory.mkdir(parents=True, exist_ok=True)
    tensors = _hf_tensors(model, dtype)
    save_file(tensors, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    _write_json(directory / CONFIG_FILE, config_json)
    generation = {"bos_token_id": bos, "eos_token_id": _one_or_list(eos)}
    _write_json(directory / GENERATION_FILE, generation)
    if tokenizer_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / name).is_file():
                shutil.copyfile(Path(tokenizer_dir) / name, directory / name)
    return directory


def _save_special_ids(
    config: TransformerConfig,
    tokenizer: HFTokenizer | None,
    eos_token_id: int | Sequence[int] | None,
    bos_token_id: int | None,
) -> tuple[tuple[int, ...], int | None]:
    """(EOS ids, BOS id) for `save_hf_model`: the arguments, else the tokenizer's; checked
    against the embedding's rows."""
    if tokenizer is not None and tokenizer.vocab_size > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens, the model only "
            f"{config.vocab_size} embedding rows"
        )
    if eos_token_id is None:
        if tokenizer is None:
            raise ValueError("save_hf_model needs eos_token_id or a tokenizer_dir naming EOS")
        eos_token_id = sorted(tokenizer.eos_ids)
    if bos_token_id is None and tokenizer is not None:
        bos_token_id = tokenizer.bos_id
    eos = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    for token in (*eos, *([] if bos_token_id is None else [bos_token_id])):
        if (
            not isinstance(token, int)
            or isinstance(token, bool)
            or not 0 <= token < config.vocab_size
        ):
            raise ValueError(f"special token id {token!r} is not in [0, {config.vocab_size})")
    if not eos:
        raise ValueError("save_hf_model needs at least one EOS id")
    return eos, bos_token_id


def _hf_tensors(model: Transformer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Hugging Face tensor name -> a copy of its rows of the model (the loader's plan
    inverted)."""
    params = dict(model.named_parameters())
    out = {}
    for name, target in _weight_plan(model.config).items():
        rows = params[target.param].detach()[target.start : target.start + target.shape[0]]
        out[name] = rows.to(device="cpu", dtype=dtype, copy=True).contiguous()
    return out


def _one_or_list(ids: Sequence[int]) -> int | list[int]:
    return ids[0] if len(ids) == 1 else list(ids)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


class _Fields:
    """Typed reads of one JSON object; every error names the file and the (dotted) field."""

    def __init__(self, path: Path, data: dict[str, Any], prefix: str = "") -> None:
        self.path, self.data, self.prefix = path, data, prefix

    def error(self, key: str, message: str) -> HFCheckpointError:
        return HFCheckpointError(f"{self.path}: field {self.prefix + key!r} {message}")

    def get(self, key: str, default: Any = None) -> Any:
        return self.data.get(key, default)

    def _value(self, key: str, default: Any) -> Any:
        if key in self.data:
            return self.data[key]
        if default is _REQUIRED:
            raise self.error(key, "is missing")
        return default

    def integer(self, key: str, default: Any = _REQUIRED) -> Any:
        value = self._value(key, default)
        if value is None and default is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise self.error(key, f"must be a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        value = self._value(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise self.error(key, f"must be a positive number, got {value!r}")
        return float(value)

    def flag(self, key: str, default: Any = _REQUIRED) -> bool:
        value = self._value(key, default)
        if not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {value!r}")
        return value

    def nested(self, key: str) -> _Fields:
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {value!r}")
        return _Fields(self.path, value, f"{self.prefix}{key}.")


def _read_json(path: Path) -> dict[str, Any]:
    data = read_json_object(path, HFCheckpointError)
    if data is None:
        raise HFCheckpointError(f"{path.parent}: missing {path.name}")
    return data


def _rope(f: _Fields) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` if present (its `rope_theta`, else the top-level
    one), else from the top-level `rope_theta` + `rope_scaling`."""
    if f.get("rope_parameters") is not None:
        params = f.nested("rope_parameters")
        in_params = "rope_theta" in params.data or f.get("rope_theta") is None
        theta = (params if in_params else f).number("rope_theta")
    else:
        theta = f.number("rope_theta", 10000.0)
        params = f.nested("rope_scaling") if f.get("rope_scaling") is not None else None
    for where in (f, params):
        if where is not None and where.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise where.error("partial_rotary_factor", "must be 1.0 (partial rotary unsupported)")
    if params is None:
        return theta, None
    type_key = "rope_type" if "rope_type" in params.data or "type" not in params.data else "type"
    kind = params.get(type_key, "default")
    if kind not in ROPE_TYPES:
        raise params.error(type_key, f"is {kind!r}; supported: {ROPE_TYPES}")
    if kind == "default":
        return theta, None
    try:
        if kind == "linear":
            return theta, RopeScaling("linear", params.number("factor"))
        return theta, RopeScaling(
            "llama3",
            params.number("factor"),
            params.number("low_freq_factor"),
            params.number("high_freq_factor"),
            params.integer("original_max_position_embeddings"),
        )
    except HFCheckpointError:
        raise
    except ValueError as err:
        raise params.error(type_key, f"{kind!r}: {err}") from None


def _check_sliding_window(f: _Fields, architecture: str, max_length: int) -> None:
    """Sliding-window attention equals full attention while the context fits in the window."""
    if architecture == "MistralForCausalLM":
        window = f.get("sliding_window", DEFAULT_SLIDING_WINDOW)
    elif architecture == "Qwen2ForCausalLM" and f.flag("use_sliding_window", False):
        window = f.get("sliding_window", DEFAULT_SLIDING_WINDOW)
        layer_types = f.get("layer_types")
        if isinstance(layer_types, list):
            sliding = "sliding_attention" in layer_types
        else:
            first = f.get("max_window_layers", QWEN2_MAX_WINDOW_LAYERS)
            sliding = isinstance(first, int) and first < f.integer("num_hidden_layers")
        if not sliding:
            return
    else:
        return
    if window is None:
        return
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise f.error("sliding_window", f"must be null or a positive integer, got {window!r}")
    if window < max_length:
        raise f.error(
            "sliding_window",
            f"is {window}: attention is windowed inside the requested context of {max_length} "
            f"tokens (unsupported); serve a context of at most {window} tokens",
        )


def _special_tokens(
    directory: Path, config: _Fields, vocab_size: int
) -> tuple[int | None, tuple[int, ...]]:
    """BOS: `generation_config.json`'s `bos_token_id`, else `config.json`'s. EOS: the union of
    both files' `eos_token_id` (one id or a list; generation stops on any), generation
    config's first. Every id must be a row of the embedding."""
    sources = [config]
    generation_path = directory / GENERATION_FILE
    if generation_path.is_file():
        sources.insert(0, _Fields(generation_path, _read_json(generation_path)))

    def ids(source: _Fields, key: str) -> list[int]:
        value = source.get(key)
        values = [] if value is None else value if isinstance(value, list) else [value]
        for token in values:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise source.error(key, f"must hold token ids in [0, {vocab_size}), got {value!r}")
        return values

    bos = [token for source in sources for token in ids(source, "bos_token_id")]
    eos = [token for source in sources for token in ids(source, "eos_token_id")]
    return (bos[0] if bos else None), tuple(dict.fromkeys(eos))


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: rows [start, start + shape[0]) of `param`."""

    param: str
    start: int
    shape: tuple[int, ...]


def _weight_plan(config: TransformerConfig) -> dict[str, _Target]:
    """Checkpoint tensor name -> its place in the runtime's parameters."""
    w, hd, hidden = config.width, config.head_dim, config.intermediate_size
    q_rows, kv_rows = config.num_heads * hd, config.num_kv_heads * hd
    plan = {
        "model.embed_tokens.weight": _Target("embed.weight", 0, (config.vocab_size, w)),
        "model.norm.weight": _Target("final_norm.weight", 0, (w,)),
    }
    if not config.tie_embeddings:
        plan["lm_head.weight"] = _Target("lm_head.weight", 0, (config.vocab_size, w))
    for i in range(config.num_layers):
        src, dst = f"model.layers.{i}.", f"blocks.{i}."
        plan[src + "input_layernorm.weight"] = _Target(dst + "attn_norm.weight", 0, (w,))
        plan[src + "post_attention_layernorm.weight"] = _Target(dst + "mlp_norm.weight", 0, (w,))
        fused = {
            "self_attn.q_proj": ("qkv", 0, q_rows, w, config.qkv_bias),
            "self_attn.k_proj": ("qkv", q_rows, kv_rows, w, config.qkv_bias),
            "self_attn.v_proj": ("qkv", q_rows + kv_rows, kv_rows, w, config.qkv_bias),
            "self_attn.o_proj": ("attn_out", 0, w, q_rows, config.out_bias),
            "mlp.gate_proj": ("mlp_in", 0, hidden, w, config.mlp_bias),
            "mlp.up_proj": ("mlp_in", hidden, hidden, w, config.mlp_bias),
            "mlp.down_proj": ("mlp_out", 0, w, hidden, config.mlp_bias),
        }
        for name, (param, start, rows, cols, bias) in fused.items():
            plan[f"{src}{name}.weight"] = _Target(f"{dst}{param}.weight", start, (rows, cols))
            if bias:
                plan[f"{src}{name}.bias"] = _Target(f"{dst}{param}.bias", start, (rows,))
    return plan


def _weight_files(directory: Path) -> tuple[Path, dict[str, Path]]:
    """(the file naming the weights, tensor name -> the safetensors file holding it)."""
    index_path, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
    if index_path.is_file():
        f = _Fields(index_path, _read_json(index_path))
        weight_map = f.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise f.error("weight_map", "must map tensor names to shard files")
        files = {}
        for name, shard in weight_map.items():
            if not isinstance(shard, str) or Path(shard).name != shard:
                raise f.error(f"weight_map.{name}", f"must be a file name, got {shard!r}")
            if not (directory / shard).is_file():
                raise f.error(f"weight_map.{name}", f"names {shard}, which is missing")
            files[name] = directory / shard
        return index_path, files
    if not single.is_file():
        hint = " (only safetensors weights are supported)" if any(directory.glob("*.bin")) else ""
        raise HFCheckpointError(f"{directory}: missing {WEIGHTS_FILE} or {INDEX_FILE}{hint}")
    with _open(single) as handle:
        return single, dict.fromkeys(handle.keys(), single)


@contextmanager
def _open(path: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise HFCheckpointError(f"{path}: unreadable safetensors file: {err}") from None
    with handle:
        yield handle


def _check_weights(
    weights_file: Path,
    files: dict[str, Path],
    handles: dict[Path, Any],
    plan: dict[str, _Target],
    config: TransformerConfig,
) -> tuple[str, ...]:
    """Every planned tensor present, shaped and typed as planned; nothing else. Returns the
    stored dtypes."""
    missing = [name for name in plan if name not in files]
    if missing:
        raise HFCheckpointError(
            f"{weights_file}: missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    ignored = {"lm_head.weight"} if config.tie_embeddings else set()
    unexpected = [
        name
        for name in files
        if name not in plan and name not in ignored and not name.endswith(_IGNORED_SUFFIXES)
    ]
    if unexpected:
        raise HFCheckpointError(
            f"{weights_file}: unexpected tensor {unexpected[0]!r} ({len(unexpected)} in all): "
            "not part of the configured architecture"
        )
    stored = set()
    present = {path: set(handle.keys()) for path, handle in handles.items()}
    for name, target in plan.items():
        handle = handles[files[name]]
        if name not in present[files[name]]:
            raise HFCheckpointError(f"{files[name]}: missing tensor {name!r} ({weights_file})")
        view = handle.get_slice(name)
        shape, kind = tuple(view.get_shape()), view.get_dtype()
        if shape != target.shape:
            raise HFCheckpointError(
                f"{files[name]}: tensor {name!r} has shape {shape}, {CONFIG_FILE} implies "
                f"{target.shape}"
            )
        if kind not in STORED_DTYPES:
            raise HFCheckpointError(
                f"{files[name]}: tensor {name!r} is stored as {kind}; supported: "
                f"{sorted(STORED_DTYPES)}"
            )
        stored.add(STORED_DTYPES[kind])
    return tuple(sorted(stored))


def _copy_weights(
    model: Transformer,
    files: dict[str, Path],
    handles: dict[Path, Any],
    plan: dict[str, _Target],
) -> None:
    """Copy each tensor, converted, from its mapped file into its rows of the model."""
    params = dict(model.named_parameters())
    filled = dict.fromkeys(params, 0)
    by_file: dict[Path, list[str]] = {}
    for name in plan:
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for path, names in by_file.items():
            mapped = _MappedWeights(path)
            try:
                for name in sorted(names, key=mapped.offset):  # read each file front to back
                    target = params[plan[name].param]
                    start, rows = plan[name].start, plan[name].shape[0]
                    mapped.copy_into(name, target[start : start + rows])
                    filled[plan[name].param] += target[start : start + rows].numel()
            finally:
                mapped.close()
    unfilled = [name for name, n in filled.items() if n != params[name].numel()]
    if unfilled:  # the plan and the model disagree: a bug here, not in the checkpoint
        raise RuntimeError(f"weight plan left parameters unfilled: {unfilled}")


class _MappedWeights:
    """One safetensors file mapped into memory; each tensor is read as a view of its bytes.

    `safe_open(...).get_tensor` copies a tensor out of its mapping and keeps every page it read
    mapped (resident) until the file is closed, so a whole-file load holds the model, the
    file's pages and the allocator's leftovers at once (measured: 2.5x the weights). Here each
    tensor goes straight from the mapped bytes into the model (converted by `copy_`) and its
    pages are then dropped from the mapping (MADV_DONTNEED; they stay in the page cache):
    resident memory stays near the model's size. The file layout (8-byte little-endian header
    size, JSON header with `dtype`, `shape`, `data_offsets`, then the data) is the safetensors
    format; `_check_weights` has already validated it through `safe_open`.
    """

    _DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            # copy-on-write: a writable buffer for torch.frombuffer; nothing is ever written
            self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        (size,) = struct.unpack("<Q", self.map[:8])
        self.header = json.loads(self.map[8 : 8 + size])
        self.data_start = 8 + size

    def offset(self, name: str) -> int:
        return self.header[name]["data_offsets"][0]

    def copy_into(self, name: str, dest: torch.Tensor) -> None:
        entry = self.header[name]
        dtype = self._DTYPES[entry["dtype"]]
        if tuple(entry["shape"]) != tuple(dest.shape):  # safe_open agreed; a changed file?
            raise HFCheckpointError(
                f"{self.path}: tensor {name!r} changed shape to {entry['shape']} while loading"
            )
        begin, end = entry["data_offsets"]
        start, nbytes = self.data_start + begin, end - begin
        if start % dtype.itemsize:  # misaligned for its dtype: copy its bytes out first
            source = torch.frombuffer(bytearray(self.map[start : start + nbytes]), dtype=dtype)
        else:
            source = torch.frombuffer(
                self.map, dtype=dtype, count=nbytes // dtype.itemsize, offset=start
            )
        dest.copy_(source.view(dest.shape))
        del source  # the mapping cannot close while a view of it lives
        first = start - start % mmap.PAGESIZE
        if hasattr(mmap, "MADV_DONTNEED"):
            self.map.madvise(mmap.MADV_DONTNEED, first, start + nbytes - first)

    def close(self) -> None:
        self.map.close()
