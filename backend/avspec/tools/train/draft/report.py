"""The trained draft's held-out report, and the draft written as a Hugging Face directory.

The draft is read from the training checkpoint, measured against the target run live on the
held-out chunks (`evaluate.exact_acceptance`: the target in the served
default precision, `auto_dtype`), and saved with
`avspec.runtime.hf_checkpoint.save_hf_model` in bf16 with the target's tokenizer files (so the
pair check sees one tokenizer). A draft trained with a reduced vocabulary is measured as served
(`evaluate.served_draft`). A target-layers draft (its embedding the target's, frozen) is also
split (`avspec.tools.train.draft_embedding.split`): `draft_layers.safetensors` and
`shared_embedding.json` are what is committed, `model.safetensors` is assembled from them and the
target. The report (`<work>/report.json`) holds the figures, the training log's last line and
the size of the weights that ship.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from avspec.engine.draft_vocab import DraftVocab
from avspec.runtime.hf_checkpoint import save_hf_model
from avspec.runtime.model_dir import load_model
from avspec.runtime.precision import auto_dtype
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.data import RAW_HELDOUT
from avspec.tools.train.draft.evaluate import (
    acceptance_by_depth,
    exact_acceptance,
    load_chunks,
    served_draft,
)
from avspec.tools.train.draft.model import skeleton
from avspec.tools.train.draft.train import CHECKPOINT, LOG
from avspec.tools.train.draft_embedding import split

MAX_DRAFT_BYTES = 40 * 1000 * 1000


def load_checkpoint_draft(
    target: Transformer, work: Path
) -> tuple[Transformer, dict, DraftVocab | None]:
    """(the draft in eval mode, the checkpoint's progress fields, the draft vocabulary it was
    trained with or None) from `<work>/checkpoint.pt`."""
    state = torch.load(work / CHECKPOINT, weights_only=False)
    draft = skeleton(target.config, state["shape"])
    draft.load_state_dict(state["model"])
    progress = {k: state[k] for k in ("step", "elapsed", "seen", "shape")}
    if state.get("init_from"):
        progress["init_from"] = state["init_from"]
    kept = state.get("kept_ids")
    vocab = None if kept is None else DraftVocab.of(kept, target.config.vocab_size, "checkpoint")
    return draft.eval(), progress, vocab


def write_report(target_dir: Path | str, work: Path | str, out: Path | str | None) -> dict:
    """Measure the checkpoint's draft on the held-out chunks; save it to `out` (if given) as a
    bf16 `LlamaForCausalLM` directory; write and return the report."""
    work = Path(work)
    dtype = auto_dtype()
    target = load_model(target_dir, dtype=dtype, max_length=1024)
    draft, progress, vocab = load_checkpoint_draft(target, work)
    heldout = load_chunks(work / "heldout")
    served = served_draft(draft, vocab)
    report: dict[str, Any] = {
        "training": progress,
        "parameters": draft.num_parameters(),
        "draft_vocab": None if vocab is None else len(vocab.token_ids),
        "heldout": exact_acceptance(served, target, heldout),
        "acceptance_by_depth": acceptance_by_depth(served, target, heldout),
        "target_dtype": str(dtype).removeprefix("torch."),
    }
    raw = load_chunks(work / RAW_HELDOUT)
    if raw:  # raw completions held out, apart from the chat ones
        report["heldout_raw"] = exact_acceptance(served, target, raw)
    if "init_from" in progress:  # a fine-tune: the draft it started from, on the same chunks
        start = served_draft(load_model(progress["init_from"], dtype=torch.float32), vocab)
        report["init"] = {"heldout": exact_acceptance(start, target, heldout)}
        if raw:
            report["init"]["heldout_raw"] = exact_acceptance(start, target, raw)
    log = work / LOG
    if log.is_file():
        report["last_log"] = json.loads(log.read_text().splitlines()[-1])
    if out is not None:
        out = Path(out)
        save_hf_model(draft, out, target_dir, dtype=torch.bfloat16)
        shipped = out / "model.safetensors"
        if "target_layers" in progress["shape"]:
            source = Path(target_dir) / "gguf_source.json"
            shipped = split(out, json.loads(source.read_text()) if source.is_file() else None)
        size = shipped.stat().st_size
        report["saved"] = {"directory": str(out), "shipped": shipped.name, "bytes": size}
        if size > MAX_DRAFT_BYTES:
            raise ValueError(f"{out}: {size} bytes of weights, over the {MAX_DRAFT_BYTES} limit")
    text = json.dumps(report, indent=2) + "\n"
    (work / "report.json").write_text(text)
    if out is not None:  # the card's training summary reads it beside the draft
        (Path(out) / "training_report.json").write_text(text)
    return report
