"""client/collect_drafts.py and client/eval_estimator.py end to end on a tiny random pair."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.client_scripts import load_client_script
from helpers.hf_dirs import llama_form_config, save_transformer_dir

from avspec.av.cost_file import save_step_cost
from avspec.av.cost_table import CostTable
from avspec.av.step_cost import StepCost
from avspec.runtime.transformer import Transformer
from avspec.tools.train.features_zoo import ZOO_FEATURES

collect_drafts = load_client_script("collect_drafts")
eval_estimator = load_client_script("eval_estimator")


@pytest.fixture(scope="module")
def drafts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("drafts")
    torch.manual_seed(0)  # test code: Transformer initialises from the global generator
    config = llama_form_config(num_layers=1, width=32, max_length=128)
    target, draft = Transformer(config), Transformer(config)
    with torch.no_grad():  # random init copies its input; larger blocks make it less certain
        for model in (target, draft):
            for name, p in model.named_parameters():
                if name.startswith("blocks.") and p.dim() == 2:
                    p.mul_(6.0)
        for t, d in zip(target.parameters(), draft.parameters(), strict=True):
            d.copy_(t + 0.3 * t.std().clamp_min(1e-3) * torch.randn(t.shape))
    save_transformer_dir(tmp / "target", target)  # Hugging Face checkpoints, byte-level tokenizer
    save_transformer_dir(tmp / "draft", draft)
    (tmp / "w").mkdir()
    for name in ("code", "prose"):
        lines = [json.dumps({"prompt": f"{name} prompt {i}: "}) for i in range(4)]
        (tmp / "w" / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp / "drafts.npz"
    threads = torch.get_num_threads()
    rc = collect_drafts.main([
        "--target-dir", str(tmp / "target"), "--draft-dir", str(tmp / "draft"),
        "--workload-dir", str(tmp / "w"), "--workloads", "code,prose", "--prompts", "4",
        "--max-tokens", "12", "--concurrency", "2", "--k", "3", "--max-length", "128",
        "--refit-interval", "3", "--cost-tables", str(tmp / "none.json"), "--out", str(out),
    ])  # fmt: skip
    torch.set_num_threads(threads)
    assert rc == 0
    return out


def test_collected_rows_are_consistent(drafts: Path):
    with np.load(drafts) as npz:
        d = {k: npz[k] for k in npz.files}
    rows = d["step"].size
    assert list(d["workloads"]) == ["code", "prose"]
    assert set(np.unique(d["workload"])) == {0, 1}
    for name in ("logit_qmax", "served_pred", *ZOO_FEATURES):
        assert d[name].shape == (rows, 3) and np.isfinite(d[name]).all()
    assert (d["num_accepted"] <= d["num_draft"]).all() and (d["num_draft"] <= 3).all()
    assert (np.diff(d["step"]) >= 0).all() and d["base_tokens"].size == d["step"].max() + 1
    assert d["final_intercepts"].shape == (2, 3) and (d["refits"] > 0).any()
    # AV off: every requested draft was verified, so some drafts were rejected or accepted
    assert d["num_draft"].sum() > 0
    # the served feature is logit(q_max): its sigmoid is exp(log q_max) (float32 tolerance)
    drafted = np.arange(3) < d["num_draft"][:, None]
    qmax = 1 / (1 + np.exp(-d["logit_qmax"].astype(np.float64)))
    assert np.allclose(qmax[drafted], np.exp(d["log_qmax"][drafted]), atol=1e-4)


def test_eval_estimator_report(drafts: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    costs = tmp_path / "costs.json"
    cost = StepCost(
        CostTable([1, 8], [0.2, 0.3], name="draft_pass"),
        CostTable([1, 64], [5.0, 20.0], name="verify"),
        overhead_ms=0.5,
    )
    save_step_cost(costs, cost, {"source": "test"})
    out = tmp_path / "eval.json"
    assert eval_estimator.main([str(drafts), "--cost-tables", str(costs), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for heading in ("Feature table: all", "By draft position", "Coefficients", "Oracle bound"):
        assert heading in printed
    result = json.loads(out.read_text())
    names = [r["feature"] for r in result["feature_tables"]["all"]]
    assert names[0].startswith("logit q_max, fitted online") and len(names) == 8
    assert set(result["coefficients"]) == {"code", "prose"}
    o = result["oracle"]["code"]
    assert o["oracle"]["tokens_per_ms"] >= o["fixed"]["tokens_per_ms"]
    for arm in ("av", "av_warm", "av_drafting", "av_drafting_warm"):
        assert o[arm]["tokens_per_ms"] > 0, arm
    assert "AV+drafting warm tok/ms" in printed


def test_eval_estimator_missing_cost_tables(drafts: Path, tmp_path: Path):
    with pytest.raises(SystemExit):
        eval_estimator.main([str(drafts), "--cost-tables", str(tmp_path / "nope.json")])


def test_eval_estimator_refuses_old_format_cost_tables(
    drafts: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    """The old {"draft_cost", "verify_cost"} file is no step cost: a usage error naming it."""
    old = tmp_path / "old.json"
    old.write_text(json.dumps({
        "draft_cost": {"sizes": [1, 8], "millis": [1.0, 1.5]},
        "verify_cost": {"sizes": [1, 64], "millis": [5.0, 20.0]},
    }))  # fmt: skip
    with pytest.raises(SystemExit):
        eval_estimator.main([str(drafts), "--cost-tables", str(old)])
    assert "old format" in capsys.readouterr().err


def test_collect_drafts_falls_back_to_the_default_step_cost(tmp_path: Path):
    """A missing cost file gives default_step_cost; a present one is loaded as it is."""
    fallback = collect_drafts.step_cost(tmp_path / "none.json", 4, 512)
    assert isinstance(fallback, StepCost) and fallback.overhead_ms == 0.0
    assert float(fallback.verify(0)) == 10.0 and float(fallback.draft_pass(0)) == 1.0
    path = tmp_path / "costs.json"
    cost = StepCost(CostTable([1], [0.5]), CostTable([1, 8], [2.0, 3.0]), overhead_ms=0.25)
    save_step_cost(path, cost, None)
    loaded = collect_drafts.step_cost(path, 4, 512)
    assert loaded.overhead_ms == 0.25 and loaded.verify.millis == [2.0, 3.0]
