"""`avspec.tools.train.draft.card_drafters`: the model card's section on both drafters.

On the tiny seeded chat pair (its target's output matrix tied to its embedding, as a head
needs) and a head started from the target's block, over three workload
files of 6 prompts each:

- every workload has both drafters' acceptance by position at 0.7 / 0.95 and greedy, and the
  calibration fit at 0.7; greedy acceptance of one context is 0 or 1, so a position's mean is a
  count over the contexts;
- the target standing in for the draft model is accepted everywhere (1.0 at every position,
  both settings): the chains compare each drafter with the target on the contexts it drafted;
- the section renders both tables, the calibration rows and the costs' absence.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from helpers.chat_pair import add_chat_template, save_smooth_chat_pair
from helpers.hf_dirs import save_transformer_dir

from avspec.runtime.head import HeadSpec, head_config, new_head, save_head
from avspec.runtime.model_dir import load_model, load_tokenizer
from avspec.runtime.transformer import Transformer
from avspec.tools.train.draft.card_drafters import (
    DEPTH,
    DRAFTERS,
    WORKLOADS,
    drafters,
    measure_drafters,
    render_drafters,
)

pytestmark = pytest.mark.usefixtures("single_thread")

COUNT = 6


@pytest.fixture(scope="module")
def section(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafters")
    untied_dir, draft_dir = save_smooth_chat_pair(root / "pair")
    untied = load_model(untied_dir, dtype=torch.float32)
    target = Transformer(dataclasses.replace(untied.config, tie_embeddings=True)).eval()
    state = {k: v for k, v in untied.state_dict().items() if not k.startswith("lm_head")}
    target.load_state_dict(state, strict=False)  # a head reads a tied output matrix
    target_dir = save_transformer_dir(root / "target", target)
    add_chat_template(target_dir)
    head = new_head(target, init_layer=0)
    save_head(head, HeadSpec(head_config(target.config), 0, None), root / "head")
    workloads = root / "workloads"
    workloads.mkdir()
    for name in WORKLOADS:
        rows = [{"prompt": f"{name} prompt {i}: the cat", "workload": name} for i in range(COUNT)]
        (workloads / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tokenizer = load_tokenizer(target_dir)
    models = drafters(target, load_model(draft_dir, dtype=torch.float32), draft_dir, root / "head")
    paths = {"workloads": workloads, "target": target_dir, "draft": draft_dir,
             "head": root / "head"}  # fmt: skip
    measured = measure_drafters(target, tokenizer, models, paths, count=COUNT, seed=0)
    oracle = measure_drafters(target, tokenizer, {"draft model": target, "head": target}, paths,
                              count=COUNT, seed=0)  # fmt: skip
    return measured, oracle


def test_both_drafters_at_both_settings(section):
    measured, _ = section
    assert set(measured["workloads"]) == set(WORKLOADS)
    for entry in measured["workloads"].values():
        n = entry["contexts"]
        assert 0 < n <= COUNT
        for drafter in DRAFTERS:
            for warp in ("0.7", "greedy"):
                table = entry[f"{drafter} {warp}"]
                assert [r["position"] for r in table] == list(range(1, DEPTH + 1))
                assert all(0.0 <= r["acceptance"] <= 1.0 for r in table)
            greedy = [r["acceptance"] * n for r in entry[f"{drafter} greedy"]]
            assert all(abs(c - round(c)) < 1e-6 for c in greedy)
            assert "slope" in entry[f"{drafter} calibration"]


def test_the_target_as_its_own_drafter_is_always_accepted(section):
    _, oracle = section
    for entry in oracle["workloads"].values():
        for drafter in DRAFTERS:
            for warp in ("0.7", "greedy"):
                assert all(r["acceptance"] == pytest.approx(1.0, abs=1e-5)
                           for r in entry[f"{drafter} {warp}"])  # fmt: skip


def test_the_section_renders(section):
    text = "\n".join(render_drafters(section[0]))
    assert text.startswith("## The draft head beside the draft model")
    assert "Acceptance by position, temperature 0.7 / top-p 0.95:" in text
    assert "Acceptance by position, greedy:" in text
    assert "| chat draft model | chat head |" in text
    assert text.count("| chat | ") == 2 and "no cost file given" in text
