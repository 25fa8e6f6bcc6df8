"""A GGUF model run by llama.cpp, with the runtime's `forward_cached` / `logits` face.

`GGUFModel.forward_cached(pool, seq_ids, input_ids, lengths, at=...)` appends each sequence's
tokens in one `llama_decode` (split only past `batch_tokens` tokens, e.g. a long prompt), asks
llama.cpp for logits at the packed tokens `at` only (every token when None), and returns them
[n, vocab] float32 as a view of llama.cpp's output buffer: valid until the next call on this
model, so a caller that keeps logits past that copies the rows it keeps (the stages index them,
which copies). The model's "hidden state" is its logits (`hidden=True` is accepted and changes
nothing, `logits(x)` returns x): ggml computes the output layer itself, for the asked-for rows.

With `EngineSettings.features` the context also returns llama.cpp's embeddings with no pooling:
the last block's output after the final norm, what a draft head reads (the torch runtime's
`final_norm(hidden)`). llama.cpp then outputs every token of a batch (its logits too, whatever
`at` asks for), and `features()` holds the last call's [tokens, width] rows.

The batch is the caller's buffers: token, position, sequence id and output flag are numpy
arrays that a `llama_batch` points into, filled by vectorised assignment (no per-token call).
`threads` (0: every core this process may run on) serve both single-token and batch graphs.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from avspec.checks import check_shape
from avspec.runtime.gguf.llama import check_architecture, llama_config
from avspec.runtime.gguf.reader import GGUFError, GGUFFile
from avspec.runtime.kv_cache import CacheLimitError
from avspec.runtime.llamacpp.binding import llama_cpp
from avspec.runtime.llamacpp.sequences import SequencePool

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSettings:
    """How one llama.cpp context is sized."""

    max_sequences: int  # llama.cpp sequence ids (<= 256)
    pool_tokens: int  # KV cells shared by every sequence
    max_outputs: int  # logits rows one call may ask for (rows x (K + 1) for a target step)
    threads: int = 0  # 0: every core this process may run on
    batch_tokens: int = 512  # tokens per llama_decode; a longer call is split
    max_length: int = 0  # positions per sequence (0: the model's trained context)
    # ggml's flash attention: it skips the cells of other sequences in the shared pool, where
    # the plain path multiplies by all of them (4-5x slower at 16-64 rows of 128 positions)
    flash_attention: bool = True
    unified: bool = True  # one KV pool for all sequences (else pool_tokens / max_sequences each)
    # also return the final norm's output at every token (llama.cpp's embeddings, no pooling)
    features: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.max_sequences <= 256:
            raise ValueError(f"max_sequences must lie in 1..256, got {self.max_sequences}")
        for name in ("pool_tokens", "max_outputs", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.threads < 0 or self.max_length < 0:
            raise ValueError(f"threads and max_length must be >= 0, got {self.threads}, "
                             f"{self.max_length}")  # fmt: skip

    @property
    def thread_count(self) -> int:
        return self.threads or len(os.sched_getaffinity(0))


class GGUFModel:
    """One GGUF file loaded by llama.cpp with one context (its KV pool and output buffer)."""

    def __init__(self, path: Path | str, settings: EngineSettings) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{self.path}: no such GGUF file")
        gguf = GGUFFile(self.path)  # a truncated or foreign file fails here, by name
        check_architecture(gguf)
        config = llama_config(gguf)
        self.settings = settings
        self.binding = lib = llama_cpp()
        model_params = lib.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self._model = lib.llama_model_load_from_file(str(self.path).encode(), model_params)
        if not self._model:
            raise GGUFError(f"{self.path}: llama.cpp could not load the model (see the log)")
        self.vocab_size = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self._model)))
        trained = int(lib.llama_model_n_ctx_train(self._model)) or config.max_length
        self.max_length = min(settings.max_length or trained, trained)
        params = lib.llama_context_default_params()
        params.n_ctx = settings.pool_tokens
        params.n_batch = params.n_ubatch = settings.batch_tokens
        params.n_seq_max = settings.max_sequences
        params.n_outputs_max = settings.max_outputs
        if settings.features:  # every token of a decode is an output then
            params.embeddings = True
            params.pooling_type = lib.LLAMA_POOLING_TYPE_NONE
            params.n_outputs_max = max(settings.max_outputs, settings.batch_tokens)
        params.n_threads = params.n_threads_batch = settings.thread_count
        params.kv_unified = settings.unified  # one pool: sequences take the cells they use
        params.flash_attn_type = (
            lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
            if settings.flash_attention
            else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        )
        params.no_perf = True
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise RuntimeError(f"{self.path}: llama.cpp could not create a context (see the log)")
        self._batch = _Batch(lib, settings.batch_tokens)
        self.width = int(lib.llama_model_n_embd(self._model))
        self._features = torch.empty(0, self.width)
        self.device = torch.device("cpu")
        logger.info(
            "llama.cpp %s: %d threads, KV pool %d cells shared by up to %d sequences "
            "(at most %d positions each)",
            self.path.name, settings.thread_count, settings.pool_tokens, settings.max_sequences,
            self.max_length,
        )  # fmt: skip

    def new_cache(
        self,
        max_sequences: int | None = None,
        max_length: int | None = None,
        device: str | torch.device = "cpu",
    ) -> SequencePool:
        """The KV pool of this model's context: up to `max_sequences` sequences (default: the
        context's) of up to `max_length` positions (default: the model's), on the CPU. The
        pools share llama.cpp's one memory: a new pool clears it, and the previous one must not
        be used afterwards."""
        sequences = max_sequences or self.settings.max_sequences
        length = max_length or self.max_length
        if sequences > self.settings.max_sequences or length > self.max_length:
            raise ValueError(
                f"a pool of {sequences} sequences x {length} positions exceeds the context's "
                f"{self.settings.max_sequences} x {self.max_length}"
            )
        if torch.device(device).type != "cpu":
            raise ValueError(f"the llama.cpp engine runs on the cpu, not {device}")
        memory = self.binding.llama_get_memory(self._ctx)
        self.binding.llama_memory_clear(memory, True)
        return SequencePool(memory, self.binding, sequences, self.settings.pool_tokens, length)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The identity: `forward_cached` returns logits already."""
        return x

    def forward_cached(
        self,
        cache: SequencePool,
        seq_ids: Sequence[int],
        input_ids: torch.Tensor,
        lengths: Sequence[int],
        *,
        hidden: bool = False,
        at: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append packed tokens to cached sequences; logits [n, vocab] at the packed tokens
        `at` [n] (ascending; None: every token). On an error nothing stays appended."""
        del hidden  # ggml applies the output layer itself, to the asked-for rows only
        lengths = [int(n) for n in lengths]
        check_shape("input_ids", input_ids, (sum(lengths),))
        if len(seq_ids) != len(lengths) or any(n < 1 for n in lengths):
            raise ValueError(
                f"need one length >= 1 per seq id, got {len(seq_ids)} ids, lengths {lengths}"
            )
        total = sum(lengths)
        asked = None if at is None else _outputs(at, total)
        # with features llama.cpp outputs every token
        wanted = asked if asked is not None and not self.settings.features else np.ones(total, bool)
        count = int(wanted.sum())
        if count > self.settings.max_outputs and not self.settings.features:
            raise ValueError(
                f"{count} logits rows asked for, past the context's {self.settings.max_outputs} "
                "(max_outputs)"
            )
        places = cache.reserve(seq_ids, lengths)
        seq = np.repeat([p[0] for p in places], lengths).astype(np.int32)
        starts = np.repeat([p[1] for p in places], lengths)
        offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        tokens = input_ids.to(torch.int32).numpy()
        pos = (starts + offsets).astype(np.int32)
        chunks: list[torch.Tensor] = []
        features: list[torch.Tensor] = []
        try:
            for first in range(0, total, self.settings.batch_tokens):
                part = slice(first, min(first + self.settings.batch_tokens, total))
                self._decode(tokens[part], pos[part], seq[part], wanted[part])
                rows = int(wanted[part].sum())
                if rows:
                    chunks.append(self._output_view(rows))
                    if self.settings.features:
                        features.append(self._features_view(rows))
                    if first + self.settings.batch_tokens < total:  # the next decode reuses it
                        chunks[-1] = chunks[-1].clone()
                        features[-1:] = [f.clone() for f in features[-1:]]
        except BaseException:
            for (llama_id, start), _ in zip(places, lengths, strict=True):
                self.binding.llama_memory_seq_rm(cache.memory, llama_id, start, -1)
            raise
        cache.advance(seq_ids, lengths)
        if self.settings.features:
            self._features = (
                features[0]
                if len(features) == 1
                else torch.cat([torch.empty(0, self.width), *features])
            )
            if at is not None and chunks:  # every token got logits; keep the asked-for rows
                return torch.cat(chunks)[at.to("cpu", torch.int64)]
        if not chunks:
            return torch.empty(0, self.vocab_size)
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks)

    def features(self) -> torch.Tensor:
        """The last `forward_cached` call's final-norm output at every packed token [tokens,
        width] float32 (a view of llama.cpp's buffer, valid until the next call); needs
        `EngineSettings.features`."""
        if not self.settings.features:
            raise ValueError(f"{self.path.name}: features need EngineSettings.features")
        return self._features

    def _decode(
        self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, out: np.ndarray
    ) -> None:
        batch = self._batch.fill(tokens, pos, seq, out)
        status = self.binding.llama_decode(self._ctx, batch)
        if status == 1:
            raise CacheLimitError("llama.cpp found no KV cells for the batch (the pool is full)")
        if status == -1:
            raise RuntimeError(
                "llama_decode refused the batch: its positions do not follow the sequences' "
                "cached positions, or a token is out of range (llama.cpp's log says which)"
            )
        if status != 0:
            raise RuntimeError(f"llama_decode failed with status {status}")

    def _output_view(self, rows: int) -> torch.Tensor:
        """The last decode's logits [rows, vocab] as a view of llama.cpp's buffer."""
        pointer = self.binding.llama_get_logits(self._ctx)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(rows, self.vocab_size)))

    def _features_view(self, rows: int) -> torch.Tensor:
        """The last decode's embeddings [rows, width] as a view of llama.cpp's buffer."""
        pointer = self.binding.llama_get_embeddings(self._ctx)
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(rows, self.width)))

    def close(self) -> None:
        """Free the context and the model (the object is unusable afterwards)."""
        if getattr(self, "_ctx", None):
            self.binding.llama_free(self._ctx)
            self._ctx = None
        if getattr(self, "_model", None):
            self.binding.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the library may be gone
            self.close()


def _outputs(at: torch.Tensor, total: int) -> np.ndarray:
    """[total] bool of the packed tokens whose logits `at` asks for (ascending, in range)."""
    index = at.to("cpu", torch.int64).numpy()
    if len(index) and (index.min() < 0 or index.max() >= total):
        raise ValueError(f"at holds positions outside 0..{total - 1}")
    if len(index) > 1 and not (np.diff(index) > 0).all():
        raise ValueError("at must be strictly ascending (llama.cpp returns rows in batch order)")
    wanted = np.zeros(total, dtype=bool)
    wanted[index] = True
    return wanted


class _Batch:
    """A `llama_batch` whose arrays are numpy buffers owned here (capacity `size` tokens)."""

    def __init__(self, lib: object, size: int) -> None:
        self.token = np.zeros(size, dtype=np.int32)
        self.pos = np.zeros(size, dtype=np.int32)
        self.n_seq_id = np.ones(size, dtype=np.int32)
        self.seq = np.zeros(size, dtype=np.int32)
        self.logits = np.zeros(size, dtype=np.int8)
        seq_ptr = ctypes.POINTER(ctypes.c_int32)
        base = self.seq.ctypes.data
        self.seq_ids = (seq_ptr * size)(*(ctypes.cast(base + 4 * i, seq_ptr) for i in range(size)))
        self.batch = lib.llama_batch()  # type: ignore[attr-defined]
        self.batch.token = self.token.ctypes.data_as(seq_ptr)
        self.batch.embd = None
        self.batch.pos = self.pos.ctypes.data_as(seq_ptr)
        self.batch.n_seq_id = self.n_seq_id.ctypes.data_as(seq_ptr)
        self.batch.seq_id = ctypes.cast(self.seq_ids, ctypes.POINTER(seq_ptr))
        self.batch.logits = self.logits.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def fill(self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, out: np.ndarray) -> object:
        n = len(tokens)
        self.token[:n], self.pos[:n], self.seq[:n], self.logits[:n] = tokens, pos, seq, out
        self.batch.n_tokens = n
        return self.batch
