"""`python -m avspec.tools.train.draft` without `--only`, on a tiny tied chat pair: the data phase
runs in a second process while training starts on its first chunk, then the report saves the draft
split (its layers + the shared embedding's manifest) and the card is written; the split draft
assembles back into the checkpoint the report saved."""

from __future__ import annotations

import dataclasses
import json

import torch
from helpers.chat_pair import save_smooth_chat_pair

from avspec.runtime.hf_writer import save_hf_model
from avspec.runtime.model_dir import load_model
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.__main__ import main
from avspec.tools.train.draft_embedding import LAYERS_FILE, MANIFEST_FILE, assemble


def test_data_and_training_overlap_and_the_saved_draft_assembles(tmp_path):
    smooth, _ = save_smooth_chat_pair(tmp_path / "pair")
    untied = load_model(smooth)
    target = Transformer(dataclasses.replace(untied.config, tie_embeddings=True))
    state = {k: v for k, v in untied.state_dict().items() if not k.startswith("lm_head")}
    target.load_state_dict(state, strict=False)
    target_dir = save_hf_model(target, tmp_path / "target", tokenizer_dir=smooth)
    work, out = tmp_path / "work", tmp_path / "out"
    main([
        "--target", str(target_dir), "--work", str(work), "--out", str(out),
        "--train-prompts", "4", "--heldout-prompts", "2", "--max-new-tokens", "8",
        "--batch", "4", "--minutes", "0.03", "--target-layers", "1,0", "--card-contexts", "4",
    ])  # fmt: skip
    assert sorted(p.name for p in (work / "train").glob("chunk_*.pt")) == ["chunk_00000.pt"]
    report = json.loads((work / "report.json").read_text())
    assert report["training"]["shape"] == {"target_layers": [1, 0]}
    assert report["saved"]["shipped"] == LAYERS_FILE
    assert json.loads((out / "training_report.json").read_text()) == report
    card = (out / "MODEL_CARD.md").read_text()
    assert "from the target's blocks 1, 0 over its frozen embedding" in card
    assert "The embedding is the target's, bit for bit" in card
    assert (out / MANIFEST_FILE).is_file()
    ids = torch.tensor([[3, 5, 7, 9]])
    with torch.no_grad():
        saved = load_model(out)(ids)
        (out / "model.safetensors").unlink()
        assemble(out, target_dir)
        assert torch.equal(load_model(out)(ids), saved)
        # the draft stores bf16; this float32 target's embedding rounds to the same bytes
        shared = load_model(target_dir).embed.weight.to(torch.bfloat16).float()
        assert torch.equal(load_model(out).embed.weight, shared)
