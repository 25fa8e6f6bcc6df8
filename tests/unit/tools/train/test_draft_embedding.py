"""`avspec.tools.train.draft_embedding`: a draft stored without the embedding it shares with its
target is assembled back bit-equal, refused for another target, and refused by the loader until
then."""

from __future__ import annotations

import json

import pytest
import torch

from avspec.runtime.hf_writer import save_hf_model
from avspec.runtime.model_dir import ModelDirError, load_model
from avspec.runtime.transformer import Transformer, TransformerConfig, init_weights
from avspec.tools.train.draft.model import target_layers_draft
from avspec.tools.train.draft_embedding import (
    EMBEDDING,
    LAYERS_FILE,
    MANIFEST_FILE,
    SharedEmbeddingError,
    assemble,
    main,
    split,
)

CONFIG = TransformerConfig(
    num_layers=3, width=32, num_heads=2, num_kv_heads=1, vocab_size=48, max_length=64,
    mlp="swiglu", norm_eps=1e-5,
)  # fmt: skip
IDS = torch.tensor([[1, 4, 9, 16, 25, 36]])


def _target(seed: int) -> Transformer:
    model = Transformer(CONFIG)
    init_weights(model, torch.Generator().manual_seed(seed))
    return model.eval()


@pytest.fixture
def pair(tmp_path):
    target = _target(0)
    target_dir = save_hf_model(target, tmp_path / "target", eos_token_id=2, dtype=torch.bfloat16)
    draft = target_layers_draft(load_model(target_dir), [0, 2])
    with torch.no_grad():  # "trained": the blocks move, the embedding does not
        for p in draft.blocks.parameters():
            p.add_(0.01)
    draft_dir = save_hf_model(draft, tmp_path / "draft", eos_token_id=2, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = load_model(draft_dir)(IDS)
    split(draft_dir, {"sha256": "ab" * 32})
    (draft_dir / "model.safetensors").unlink()
    return target_dir, draft_dir, expected


def test_assembly_gives_back_the_saved_draft(pair):
    target_dir, draft_dir, expected = pair
    manifest = json.loads((draft_dir / MANIFEST_FILE).read_text())
    assert manifest["tensor"] == EMBEDDING and manifest["dtype"] == "bfloat16"
    layers = (draft_dir / LAYERS_FILE).stat().st_size
    with pytest.raises(ModelDirError, match="assemble it first"):
        load_model(draft_dir)
    out = assemble(draft_dir, target_dir)
    assert out.stat().st_size > layers  # the embedding is back in
    with torch.no_grad():
        assert torch.equal(load_model(draft_dir)(IDS), expected)


def test_another_target_is_refused_by_name(pair, tmp_path):
    _, draft_dir, _ = pair
    other = save_hf_model(_target(1), tmp_path / "other", eos_token_id=2, dtype=torch.bfloat16)
    with pytest.raises(SharedEmbeddingError, match="not the one the draft .* was trained with"):
        assemble(draft_dir, other)
    assert not (draft_dir / "model.safetensors").exists()
    wide = Transformer(TransformerConfig(**{**CONFIG.to_dict(), "vocab_size": 64}))
    wider = save_hf_model(wide, tmp_path / "wider", eos_token_id=2)
    with pytest.raises(SharedEmbeddingError, match="not its target"):
        assemble(draft_dir, wider)


def test_the_command_reports_a_problem_without_a_traceback(pair, tmp_path, capsys):
    target_dir, draft_dir, _ = pair
    (draft_dir / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main(["--target", str(target_dir), "--draft", str(draft_dir)])
    assert exit_info.value.code == 2
    assert "malformed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--target", str(target_dir), "--draft", str(tmp_path / "nowhere")])
