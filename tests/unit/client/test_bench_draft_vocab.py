"""client/bench_draft_vocab.py end to end on the tiny pair: pass times, components, acceptance
(a map of every id accepts exactly like the full vocabulary; a smaller map reports its mass)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.client_scripts import load_client_script
from helpers.server import save_tiny_pair

from avspec.engine.draft_vocab import save_draft_vocab

pytestmark = pytest.mark.usefixtures("single_thread")

bench = load_client_script("bench_draft_vocab")


def test_bench_runs_on_the_tiny_pair(tmp_path: Path) -> None:
    target, draft = save_tiny_pair(tmp_path / "pair")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(33, 120, (12,), generator=gen) for _ in range(3)]
    answers = [torch.randint(33, 120, (6,), generator=gen) for _ in range(3)]
    heldout = tmp_path / "heldout"
    heldout.mkdir()
    torch.save({"kinds": ["t"] * 3, "prompt": prompts, "answer": answers,
                "top_ids": [torch.zeros(6, 64, dtype=torch.int32)] * 3,
                "top_logits": [torch.zeros(6, 64, dtype=torch.float16)] * 3},
               heldout / "chunk_00000.pt")  # fmt: skip
    every, some = tmp_path / "every.json", tmp_path / "some.json"
    save_draft_vocab(every, range(257), "all")
    save_draft_vocab(some, range(0, 257, 2), "half")
    out = tmp_path / "bench.json"
    args = ["--target-dir", str(target), "--draft-dir", str(draft), "--maps", str(every),
            str(some), "--heldout", str(heldout), "--rows", "1", "2", "--context", "8",
            "--repeats", "1", "--warmup", "0", "--contexts", "3", "--dtype", "float32",
            "--json", str(out)]  # fmt: skip
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert set(result["timing"]["pass_ms"]) == {"full", "257", "129"}
    assert set(result["timing"]["pass_ms"]["129"]) == {"1", "2"}
    parts = result["timing"]["components"]["129"]
    assert set(parts) == {"output_layer_ms", "warp_sample_feature_ms",
                          "warp_sample_feature_kept_width_ms"}  # fmt: skip
    accept = result["heldout"]["acceptance_1"]
    assert accept["257"] == pytest.approx(accept["full"], abs=1e-6)
    assert result["heldout"]["positions"] == 18
    assert result["heldout"]["target_mass_outside"]["257"] == 0
    assert 0 < result["heldout"]["target_mass_outside"]["129"] < 1
