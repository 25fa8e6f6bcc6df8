"""Cost profiler and the profile_costs CLI, on tiny models with one repeat per point."""

from __future__ import annotations

import json
import runpy
import sys

import pytest
import torch
from helpers import ROOT
from helpers.stages import tiny_model

from avspec.runtime.model_dir import save_model_dir
from avspec.runtime.tokenizer import ByteTokenizer
from avspec.tools.profiler import CostPoints, profile_draft_cost, profile_verify_cost

CLI = ROOT / "client" / "profile_costs.py"

pytestmark = pytest.mark.usefixtures("single_thread")


def test_verify_cost_points_cover_the_token_ladder() -> None:
    seen: list[tuple[int, float]] = []
    points = profile_verify_cost(
        tiny_model(0, layers=1), 3, [1, 2], context_length=8, repeats=1, warmup=0,
        on_point=lambda size, ms: seen.append((size, ms)),
    )  # fmt: skip
    # batch 1 verifies 0..3 -> 1..4 tokens; batch 2 -> 2, 4, 6, 8 (2 and 4 measured twice).
    assert points.sizes == [1, 2, 3, 4, 6, 8]
    assert len(seen) == 8 and all(ms > 0 for ms in points.millis)
    table = points.table("verify")
    assert table.sizes == [1, 2, 3, 4, 6, 8]
    assert table.millis == sorted(table.millis)


def test_draft_cost_points_per_batch_size() -> None:
    points = profile_draft_cost(tiny_model(1, layers=1), 2, [4, 1, 4], context_length=4,
                                repeats=2, warmup=1)  # fmt: skip
    assert points.sizes == [1, 4] and len(points.millis) == 2
    assert points.to_dict() == {"sizes": [1, 4], "millis": points.millis}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_sizes": []}, "batch_sizes"),
        ({"batch_sizes": [0]}, "batch_sizes"),
        ({"context_length": 0}, "context_length"),
        ({"repeats": 0}, "repeats"),
        ({"warmup": -1}, "warmup"),
    ],
)
def test_bad_ladders(kwargs: dict, match: str) -> None:
    args = {"batch_sizes": [1], "context_length": 4, "repeats": 1, "warmup": 0} | kwargs
    for profile in (profile_draft_cost, profile_verify_cost):
        with pytest.raises(ValueError, match=match):
            profile(tiny_model(3, layers=1), 2, **args)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(CLI), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(CLI), run_name="__main__")
    assert exit_info.value.code == 0


def test_cli_writes_cost_table_json(tmp_path, monkeypatch, capsys) -> None:
    model = tiny_model(4, layers=1).float()
    for name in ("target", "draft"):
        save_model_dir(tmp_path / name, model, ByteTokenizer())
    out = tmp_path / "costs.json"
    run_cli(
        monkeypatch,
        "--target-dir", str(tmp_path / "target"), "--draft-dir", str(tmp_path / "draft"),
        "--device", "cpu", "--max-draft-tokens", "2", "--draft-batch-sizes", "1,2",
        "--verify-batch-sizes", "1", "--context", "4", "--repeats", "1", "--warmup", "0",
        "--output", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    assert result["draft_cost"]["sizes"] == [1, 2]
    assert result["verify_cost"]["sizes"] == [1, 2, 3]
    assert {"device", "date", "models"} <= set(result)
    assert "verify cost" in capsys.readouterr().out


def test_cli_help(monkeypatch, capsys) -> None:
    run_cli(monkeypatch, "--help")
    assert "cost tables" in capsys.readouterr().out


def test_cost_points_shape() -> None:
    points = CostPoints([1, 2], [0.5, 0.4])
    assert points.table("x").millis == [0.5, 0.5]
    assert torch.is_tensor(points.table("x")(3))
