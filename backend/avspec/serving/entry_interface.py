"""The public interface of the entry model `speculative`: its inputs and outputs, declared once.

Not step tensors (those are `avspec.contract`'s): what a client sends to and reads from the
served model. `avspec.serving.model_configs` renders them into the entry's config.pbtxt, and the
front derives the /generate body schema from the inputs
(`avspec.serving.front.schema.DEFAULT_GENERATE_SCHEMA`). Shared by the programs of serving, so it
imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from tritonclient.grpc import model_config_pb2 as mc


@dataclass(frozen=True)
class EntryTensor:
    """One input or output of the entry model: name, Triton data type (`mc.TYPE_*`), dims
    (batch dim excluded; [-1]: a list of values) and, for an input, whether it may be left out."""

    name: str
    data_type: int
    dims: tuple[int, ...] = (1,)
    optional: bool = False


ENTRY_INPUTS: tuple[EntryTensor, ...] = (
    EntryTensor("text_input", mc.TYPE_STRING),
    EntryTensor("max_tokens", mc.TYPE_INT32),
    EntryTensor("temperature", mc.TYPE_FP32, optional=True),
    EntryTensor("top_p", mc.TYPE_FP32, optional=True),
    EntryTensor("random_seed", mc.TYPE_UINT64, optional=True),
    EntryTensor("stream", mc.TYPE_BOOL, optional=True),
    EntryTensor("num_draft_tokens", mc.TYPE_INT32, optional=True),
    EntryTensor("adaptive_verification", mc.TYPE_BOOL, optional=True),
    EntryTensor("adaptive_drafting", mc.TYPE_BOOL, optional=True),
    EntryTensor("ignore_eos", mc.TYPE_BOOL, optional=True),
    EntryTensor("plain_spans", mc.TYPE_INT32, (-1,), optional=True),
)
ENTRY_OUTPUTS: tuple[EntryTensor, ...] = (
    EntryTensor("text_output", mc.TYPE_STRING),
    EntryTensor("drafted_tokens", mc.TYPE_INT32),
    EntryTensor("verified_tokens", mc.TYPE_INT32),
    EntryTensor("accepted_tokens", mc.TYPE_INT32),
    EntryTensor("output_ids", mc.TYPE_INT32, (-1,)),
    EntryTensor("prompt_tokens", mc.TYPE_INT32),
)
