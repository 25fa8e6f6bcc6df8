"""Model card: both models' rows, the curve and the samples; the committed card regenerates."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.hf_dirs import llama_form_config, save_transformer_dir

from avspec.runtime.transformer import Transformer
from avspec.tools.train.tiny.model_card import model_card

TINY = llama_form_config(num_layers=1, width=16, num_heads=2, max_length=64)
MODELS = Path(__file__).resolve().parents[5] / "models" / "tiny"


def test_model_card_lists_both_models_and_the_curve(tmp_path):
    models = {}
    for name in ("draft", "target"):
        save_transformer_dir(tmp_path / name, Transformer(TINY).eval())
        models[name] = {"config": TINY.to_dict(), "parameters": 1234, "train_seconds": 90.0,
                        "settings": {"steps": 10, "batch": 2, "seq": 16}}  # fmt: skip
    log = {
        "python": "3.11.7",
        "torch": "2.13.0",
        "corpus": {
            "train_files": 9,
            "train_bytes": 1000,
            "held_out_files": 1,
            "held_out_bytes": 99,
        },
        "models": models,
        "report": {
            "held_out_bpb": {"draft": 2.5, "target": 2.0},
            "acceptance_by_position": {"code": [0.7] * 8},
            "samples": {"target": {"python": "def f():"}},
        },
    }
    card = model_card(tmp_path, log)
    assert "| target | 1 | 16 | 2 (2) | swiglu 64 | 1,234 |" in card and "| 2.000 |" in card
    assert "| code | 0.700 |" in card and "def f():" in card


def test_committed_card_is_what_the_committed_log_gives():
    """models/MODEL_CARD.md is byte for byte model_card(models/training_log.json)."""
    log = json.loads((MODELS / "training_log.json").read_text())
    assert model_card(MODELS, log) == (MODELS / "MODEL_CARD.md").read_text()
