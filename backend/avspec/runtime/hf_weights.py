"""A checkpoint's weights: which tensor goes where, checked, then copied memory-mapped.

Mapping onto the runtime (`avspec.runtime.transformer`): q/k/v projections become the rows of one
fused `qkv` (q, k, v in that order), gate/up the rows of `mlp_in` (gate, up), o/down are
`attn_out`/`mlp_out`. Before anything is allocated, every tensor's presence, shape and stored
dtype (F32, F16 or BF16) is checked in files opened with safetensors' `safe_open`; then the
weights are read memory-mapped one tensor at a time and copied, converted, into the model, each
tensor's pages released once copied (`_MappedWeights`): no second copy of the model is ever
resident.
"""

from __future__ import annotations

import json
import mmap
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open  # type: ignore[attr-defined]

from avspec.runtime.hf_config import ConfigFields, HFCheckpointError, read_required_json
from avspec.runtime.hf_files import CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE
from avspec.runtime.transformer import Transformer, TransformerConfig

SERVING_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

STORED_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some older checkpoints saved


@dataclass(frozen=True)
class _Target:
    """Where a checkpoint tensor goes: rows [start, start + shape[0]) of `param`."""

    param: str
    start: int
    shape: tuple[int, ...]


def weight_plan(config: TransformerConfig) -> dict[str, _Target]:
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


def weight_files(directory: Path) -> tuple[Path, dict[str, Path]]:
    """(the file naming the weights, tensor name -> the safetensors file holding it)."""
    index_path, single = directory / INDEX_FILE, directory / WEIGHTS_FILE
    if index_path.is_file():
        f = ConfigFields(index_path, read_required_json(index_path))
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
    with open_weights(single) as handle:
        return single, dict.fromkeys(handle.keys(), single)


@contextmanager
def open_weights(path: Path) -> Iterator[Any]:
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as err:
        raise HFCheckpointError(f"{path}: unreadable safetensors file: {err}") from None
    with handle:  # type: ignore[attr-defined]  # safetensors' stub lacks __enter__
        yield handle


def check_weights(
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


def copy_weights(
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
    format; `check_weights` has already validated it through `safe_open`.
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
