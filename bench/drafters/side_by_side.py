"""Both drafters on the same held-out answers: acceptance at position 1 (and the head's depth 2-3)
and the AUC of logit(q_max), temperature 0.7 / top-p 0.95, p from the target's saved top-64 logits.

    .venv/bin/python bench/drafters/side_by_side.py > bench/drafters/side_by_side.txt
    .venv/bin/python bench/drafters/side_by_side.py build/draft-samedata   # another draft model

Reads build/drafter-data (`make draft-head`'s data phase): heldout (chat prompts of the draft
pipeline's sources, rows held out), heldout_raw (code / prose continuations), heldout_general (the
64 everyday questions of avspec.tools.bench.general_chat, a source never trained on; written here
when missing). The draft model is teacher-forced at position 1 only (one pass over the answer);
the head unrolls its own guesses for depths 2-3 as it drafts when served.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

import torch

from avspec.engine.draft_vocab import load_draft_vocab
from avspec.runtime.head import load_head
from avspec.runtime.model_dir import load_model
from avspec.tools.bench.general_chat import GENERAL_CHAT
from avspec.tools.train.draft.evaluate import approx_acceptance, load_chunks, served_draft
from avspec.tools.train.draft.generate import AnswerSettings, generate_chunks
from avspec.tools.train.draft.prompts import ChatPrompt
from avspec.tools.train.head.__main__ import GENERAL_SEED
from avspec.tools.train.head.evaluate import head_acceptance

WORK = Path("build/drafter-data")
SETS = ("heldout", "heldout_raw", "heldout_general")


def main() -> None:
    torch.set_num_threads(2)
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
    print(f"# host: {platform.processor() or 'cpu'}; flags: {[f for f in wanted if f in flags]}")
    if not (WORK / "heldout_general").is_dir():
        general = [ChatPrompt(kind, "general", text) for kind, text in GENERAL_CHAT]
        settings = AnswerSettings(64, 128, features=True)
        generate_chunks("models/target", general, WORK / "heldout_general", settings, GENERAL_SEED)
    target = load_model("models/target", max_length=1024)
    head, _ = load_head("models/head", target)
    head_kept = torch.tensor(load_draft_vocab("models/head/draft_vocab.json", 49152).token_ids)
    draft_dir = Path(sys.argv[1] if len(sys.argv) > 1 else "models/draft")
    print(f"# draft model: {draft_dir}; head: models/head")
    draft = load_model(draft_dir, max_length=1024)
    vocab = load_draft_vocab(draft_dir / "draft_vocab.json", draft.config.vocab_size)
    served = served_draft(draft, vocab)
    print(f"{'set':<16} {'seqs':>5} {'positions':>9}  {'draft acc1':>10} {'draft auc':>9}"
          f"  {'head acc1/2/3':>20} {'head auc1/2/3':>20}")  # fmt: skip
    for name in SETS:
        sequences = load_chunks(WORK / name)
        d = approx_acceptance(served, sequences, limit=len(sequences))
        h = head_acceptance(head, sequences, head_kept, depth=3)
        acc = "/".join(f"{a:.3f}" for a in h["acceptance"])
        auc = "/".join(f"{a:.3f}" for a in h["auc"])
        print(f"{name:<16} {len(sequences):>5} {d['approx_positions']:>9}  "
              f"{d['approx_acceptance_1']:>10.3f} {d['approx_auc_logit_q_max']:>9.3f}  "
              f"{acc:>20} {auc:>20}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
