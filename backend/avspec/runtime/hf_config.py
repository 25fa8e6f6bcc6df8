"""What a Hugging Face checkpoint's `config.json` (and `generation_config.json`) say, checked.

Architectures: `LlamaForCausalLM` (grouped-query attention, `head_dim`, `tie_word_embeddings`,
`attention_bias` on q/k/v/o, `mlp_bias`, `rms_norm_eps`, `rope_theta`, `rope_scaling` of type
`linear` or `llama3`), `Qwen2ForCausalLM` (bias on q/k/v, none on o) and `MistralForCausalLM`
(only while the context asked for fits in its `sliding_window`). RoPE settings are read in both
forms: the older top-level `rope_theta` + `rope_scaling`, and the newer `rope_parameters` object.
Every problem raises `HFCheckpointError` (a ValueError) naming the file and the field.
`check_llama_form` names the first `TransformerConfig` field Llama cannot express exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from avspec.runtime.hf_files import CONFIG_FILE, GENERATION_CONFIG_FILE
from avspec.runtime.json_file import read_json_object
from avspec.runtime.rope import RopeScaling
from avspec.runtime.transformer import TransformerConfig

ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")

ROPE_TYPES = ("default", "linear", "llama3")

DEFAULT_SLIDING_WINDOW = 4096  # MistralConfig and Qwen2Config default, when config.json omits it

QWEN2_MAX_WINDOW_LAYERS = 28  # Qwen2Config's default

_REQUIRED: Any = object()  # a ConfigFields default: the field must be present


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
    f = ConfigFields(config_path, read_required_json(config_path))
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


class ConfigFields:
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

    def nested(self, key: str) -> ConfigFields:
        value = self.data[key]
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {value!r}")
        return ConfigFields(self.path, value, f"{self.prefix}{key}.")


def read_required_json(path: Path) -> dict[str, Any]:
    data = read_json_object(path, HFCheckpointError)
    if data is None:
        raise HFCheckpointError(f"{path.parent}: missing {path.name}")
    return data


def _rope(f: ConfigFields) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from `rope_parameters` if present (its `rope_theta`, else the top-level
    one), else from the top-level `rope_theta` + `rope_scaling`."""
    params: ConfigFields | None
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


def _check_sliding_window(f: ConfigFields, architecture: str, max_length: int) -> None:
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
    directory: Path, config: ConfigFields, vocab_size: int
) -> tuple[int | None, tuple[int, ...]]:
    """BOS: `generation_config.json`'s `bos_token_id`, else `config.json`'s. EOS: the union of
    both files' `eos_token_id` (one id or a list; generation stops on any), generation
    config's first. Every id must be a row of the embedding."""
    sources = [config]
    generation_path = directory / GENERATION_CONFIG_FILE
    if generation_path.is_file():
        sources.insert(0, ConfigFields(generation_path, read_required_json(generation_path)))

    def ids(source: ConfigFields, key: str) -> list[int]:
        value = source.get(key)
        values = [] if value is None else value if isinstance(value, list) else [value]
        for token in values:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab_size:
                raise source.error(key, f"must hold token ids in [0, {vocab_size}), got {value!r}")
        return values

    bos = [token for source in sources for token in ids(source, "bos_token_id")]
    eos = [token for source in sources for token in ids(source, "eos_token_id")]
    return (bos[0] if bos else None), tuple(dict.fromkeys(eos))
