"""Triton model configs as text (config.pbtxt), read and written with Triton's own protobuf
schema (`tritonclient.grpc.model_config_pb2.ModelConfig`) and `google.protobuf.text_format`.

text_format keeps no comments: `render` puts a header of `#` lines above the message, and a
template's `${name}` placeholders in integer fields (which the schema cannot hold) are rendered
from stand-in integers (`Placeholders`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

ModelConfig = mc.ModelConfig

# A template's integer placeholders: {stand-in integer: placeholder name}. The stand-ins are
# large and distinct so that no real value of a config is mistaken for one.
Placeholders = Mapping[int, str]
STAND_IN_BASE = 987_654_000


def parse(text: str) -> mc.ModelConfig:
    """The ModelConfig of a config.pbtxt text; ValueError saying where it does not parse."""
    try:
        return text_format.Parse(text, mc.ModelConfig())
    except text_format.ParseError as err:
        raise ValueError(f"not a Triton model config: {err}") from None


def to_text(config: mc.ModelConfig) -> str:
    """The config in text format, dims and other numbers lists on one line."""
    return text_format.MessageToString(config, use_short_repeated_primitives=True)


def render(
    config: mc.ModelConfig, header: Iterable[str] = (), placeholders: Placeholders | None = None
) -> str:
    """config.pbtxt text: `header` as `#` comment lines, then the config; each stand-in integer
    of `placeholders` becomes its `${name}` (ValueError if one does not occur)."""
    lines = [f"# {line}".rstrip() for line in header]
    text = "\n".join(lines) + ("\n" if lines else "") + to_text(config)
    for stand_in, name in (placeholders or {}).items():
        if str(stand_in) not in text:
            raise ValueError(f"placeholder {name}: its stand-in {stand_in} is not in the config")
        text = text.replace(str(stand_in), "${" + name + "}")
    return text


def type_name(data_type: int) -> str:
    """The name of a ModelConfig data_type, e.g. "TYPE_FP32"."""
    return mc.DataType.Name(data_type)


def parameters(config: mc.ModelConfig) -> dict[str, str]:
    """{key: string_value} of the config's `parameters`, in key order (a protobuf map has no
    order of its own; text_format writes them in key order too)."""
    return {key: config.parameters[key].string_value for key in sorted(config.parameters)}


def set_parameters(config: mc.ModelConfig, values: Mapping[str, str]) -> None:
    """Set `parameters` entries (string values), adding those not there yet."""
    for key, value in values.items():
        config.parameters[key].string_value = str(value)
