"""Cost profiler and the profile_costs CLI, on tiny models with a few repeats per point."""

from __future__ import annotations

import json
import runpy
import statistics
import sys
import time
from collections.abc import Callable

import pytest
import torch
from helpers import ROOT
from helpers.hf_dirs import save_transformer_dir
from helpers.stages import tiny_model

from avspec.av.cost_file import FORMAT, load_step_cost
from avspec.tools.bench.profiler import (
    CostPoints,
    LadderSettings,
    fit_tokens_and_rows,
    interleaved_ms,
    median_ms,
    profile_draft_pass,
    profile_verify_cost,
    sample_ms,
    verify_points,
)

CLI = ROOT / "client" / "profile_costs.py"

pytestmark = pytest.mark.usefixtures("single_thread")


def test_verify_cost_points_cover_the_token_ladder() -> None:
    seen: list[tuple[int, float]] = []
    points = profile_verify_cost(
        tiny_model(0, layers=1), 3, [1, 2], LadderSettings(context_length=8, repeats=2, warmup=0),
        on_point=lambda size, ms: seen.append((size, ms)),
    )  # fmt: skip
    # batch 1 verifies 0..3 -> 1..4 tokens; batch 2 -> 2, 4, 6, 8 (2 and 4 measured twice).
    assert points.sizes == [1, 2, 3, 4, 6, 8]
    assert len(seen) == 8 and all(ms > 0 for ms in points.millis)
    # Sizes reached by two (batch, drafts) shapes pool their samples: twice the weight.
    assert points.repeats == [2, 4, 2, 4, 2, 2]
    assert [len(s) for s in points.samples] == points.repeats
    assert points.millis == [statistics.median(s) for s in points.samples]
    assert len(points.extra["shapes"]) == 8 and points.extra["shapes"][0]["size"] == 1
    table = points.table("verify")
    assert table.sizes == [1, 2, 3, 4, 6, 8] and table.weights == [2, 4, 2, 4, 2, 2]
    assert table.millis == sorted(table.millis)


def test_draft_pass_points_per_row_count() -> None:
    seen: list[tuple[int, float]] = []
    points = profile_draft_pass(
        tiny_model(1, layers=1), [4, 1, 4], passes=3,
        settings=LadderSettings(context_length=4, repeats=3, warmup=1),
        on_point=lambda rows, ms: seen.append((rows, ms)),
    )  # fmt: skip
    assert points.sizes == [1, 4] and [r for r, _ in seen] == [1, 4]
    assert points.repeats == [3, 3] and all(m >= 0 for m in points.millis)
    extra = points.extra
    assert extra["passes"] == 3 and len(extra["one_pass_ms"]) == len(extra["all_passes_ms"]) == 2
    # pass = (t_3 - t_1) / 2 per repeat; fixed = median t_1 - pass
    for i in range(2):
        assert extra["stage_fixed_ms"][i] == pytest.approx(
            extra["one_pass_ms"][i] - statistics.median(points.samples[i])
        )
    assert points.to_dict()["sizes"] == [1, 4] and "samples" in points.to_dict()


def test_sequences_are_slices_of_the_text_and_the_drafts_its_next_tokens() -> None:
    """With `text`, each sequence is a slice of it (different for each sequence id), so the
    verified drafts are the text's continuation; without, random ids below 256."""
    from avspec.tools.bench.profiler import _sequences

    text = torch.arange(1000, 1500)
    rows = _sequences(text, 3, 20, 5, torch.Generator())
    assert rows.shape == (3, 20)
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 20)) for row in rows)
    assert len({int(row[0]) for row in rows}) == 3  # three different slices
    assert int(_sequences(None, 2, 7, 1, torch.Generator().manual_seed(0)).max()) < 256
    with pytest.raises(ValueError, match="text has 500 tokens"):
        _sequences(text, 1, 500, 1, torch.Generator())


def test_workload_text_is_the_prompts_in_the_targets_tokenizer(tmp_path) -> None:
    from helpers.server import save_tiny_pair

    from avspec.runtime.model_dir import load_tokenizer
    from avspec.tools.bench.profiler import workload_text

    directory, _ = save_tiny_pair(tmp_path / "pair")
    lines = tmp_path / "w.jsonl"
    lines.write_text('{"prompt": "def f():"}\n\n{"prompt": " return 1"}\n')
    tokenizer = load_tokenizer(directory)
    want = tokenizer.encode("def f():") + tokenizer.encode(" return 1")
    assert workload_text(directory, [lines]).tolist() == want
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match="no prompts"):
        workload_text(directory, [tmp_path / "empty.jsonl"])


def test_draft_pass_needs_two_passes() -> None:
    with pytest.raises(ValueError, match="passes must be >= 2"):
        settings = LadderSettings(context_length=4, repeats=1)
        profile_draft_pass(tiny_model(1, layers=1), [1], passes=1, settings=settings)


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
    rows = args.pop("batch_sizes")
    settings = LadderSettings(**args)
    with pytest.raises(ValueError, match=match):
        profile_verify_cost(tiny_model(3, layers=1), 2, rows, settings)
    with pytest.raises(ValueError, match=match):
        profile_draft_pass(tiny_model(3, layers=1), rows, passes=2, settings=settings)


def test_sampling_helpers() -> None:
    calls: list[str] = []
    times = sample_ms(lambda: calls.append("a"), repeats=3, warmup=2, device="cpu")
    assert len(times) == 3 and calls == ["a"] * 5 and all(t >= 0 for t in times)
    assert median_ms(lambda: None, 3, 0, "cpu") >= 0


def test_interleaved_rounds() -> None:
    """Warm-up rounds, then each round times every point once, its calls back to back."""
    calls: list[str] = []
    done: list[tuple[int, int]] = []
    points = [(lambda: calls.append("a1"), lambda: calls.append("a2")),
              (lambda: calls.append("b"),)]  # fmt: skip
    timed = interleaved_ms(
        points, 2, 1, "cpu", on_done=lambda i, samples: done.append((i, len(samples[0])))
    )
    assert calls == ["a1", "a2", "b"] * 3
    assert [[len(c) for c in p] for p in timed] == [[2, 2], [2]]
    assert done == [(0, 2), (1, 2)]


def test_a_burst_lands_on_every_point() -> None:
    """A slow spell of 5 consecutive calls (all of one point's samples, timed one point after
    the other): round-robin spreads it over the points, at most 2 of 5 each; medians ignore it."""
    clock = iter(range(1000))
    slow = set(range(5, 10))

    def make() -> Callable[[], None]:
        def call() -> None:
            if next(clock) in slow:
                time.sleep(0.02)

        return call

    timed = interleaved_ms([(make(),), (make(),), (make(),)], repeats=5, warmup=0, device="cpu")
    assert all(statistics.median(p[0]) < 10.0 for p in timed)


def test_fit_tokens_and_rows() -> None:
    shapes = [{"batch": b, "size": b * (1 + n), "median_ms": 2.0 + 0.1 * b * (1 + n) + 0.3 * b}
              for b in (1, 4, 16) for n in range(3)]  # fmt: skip
    fit = fit_tokens_and_rows(shapes)
    assert fit["fixed_ms"] == pytest.approx(2.0) and fit["per_token_ms"] == pytest.approx(0.1)
    assert fit["per_row_ms"] == pytest.approx(0.3)
    assert fit["max_rel_error_with_rows"] < 1e-9 < 0.1 < fit["max_rel_error_tokens_only"]
    one_batch = [{"batch": 1, "size": 1 + n, "median_ms": 1.0 + n} for n in range(3)]
    fit = fit_tokens_and_rows(one_batch)
    assert fit["per_row_ms"] == 0.0 and fit["per_token_ms"] == pytest.approx(1.0)


def run_cli(monkeypatch: pytest.MonkeyPatch, *args: str) -> None:
    monkeypatch.setattr(sys, "argv", [str(CLI), *args])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(CLI), run_name="__main__")
    assert exit_info.value.code == 0


def test_cli_writes_step_cost_file(tmp_path, monkeypatch, capsys) -> None:
    model = tiny_model(4, layers=1, mlp="swiglu", norm_eps=1e-5).float()  # Llama form
    for name in ("target", "draft"):
        save_transformer_dir(tmp_path / name, model)
    out, png = tmp_path / "costs.json", tmp_path / "plot" / "costs.png"
    run_cli(
        monkeypatch,
        "--target-dir", str(tmp_path / "target"), "--draft-dir", str(tmp_path / "draft"),
        "--device", "cpu", "--max-draft-tokens", "2", "--draft-rows", "1,2",
        "--verify-batch-sizes", "1", "--context", "4", "--repeats", "2", "--warmup", "0",
        "--overhead-ms", "1.5", "--output", str(out), "--plot", str(png),
    )  # fmt: skip
    document = json.loads(out.read_text())
    assert document["format"] == FORMAT and document["overhead_ms"] == 1.5
    assert document["draft_pass"]["sizes"] == [1, 2]
    assert document["verify"]["sizes"] == [1, 2, 3]
    measured = document["measured"]
    assert {"device", "date", "models", "threads", "command", "repeats"} <= set(measured)
    assert measured["command"].startswith("python client/profile_costs.py --target-dir")
    assert [len(s) for s in measured["verify"]["samples"]] == [2, 2, 2]
    assert measured["draft_pass"]["repeats"] == [2, 2]
    assert {"fixed_ms", "per_token_ms", "per_row_ms"} <= set(measured["verify_by_tokens_and_rows"])
    cost = load_step_cost(out)
    assert cost.overhead_ms == 1.5 and cost.verify.millis == sorted(cost.verify.millis)
    assert png.stat().st_size > 1000
    text = capsys.readouterr().out
    assert "verify (target stage)" in text and "draft pass" in text


def test_cli_help(monkeypatch, capsys) -> None:
    run_cli(monkeypatch, "--help")
    assert "step cost" in capsys.readouterr().out


@pytest.mark.parametrize(
    "bad",
    [["--max-draft-tokens", "1"], ["--draft-rows", "a"], ["--overhead-ms", "-1"],
     ["--overhead-ms", "nan"]],
)  # fmt: skip
def test_cli_bad_arguments(monkeypatch, tmp_path, bad) -> None:
    monkeypatch.setattr(sys, "argv", [str(CLI), *bad, "--output", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_path(str(CLI), run_name="__main__")
    assert exit_info.value.code == 2
    assert not (tmp_path / "x.json").exists()


def test_cost_points_shape() -> None:
    points = CostPoints([1, 2], [0.5, 0.4])
    assert points.table("x").millis == [0.45, 0.45]
    assert torch.is_tensor(points.table("x")(3))
    weighted = CostPoints.from_samples({2: [0.4, 0.4, 0.4], 1: [0.5]})
    assert weighted.sizes == [1, 2] and weighted.repeats == [1, 3]
    assert weighted.table("x").millis == pytest.approx([0.425, 0.425])


def test_verify_points_never_net_below_zero() -> None:
    """A per-row cost above a shape's own time (a fit pulled by the other shapes) or a fast
    sample nets to 0, and the table stays valid (a negative cost would be refused)."""
    shapes = [
        {"batch": 64, "size": 64, "median_ms": 100.0},
        {"batch": 1, "size": 9, "median_ms": 40.0},
    ]
    points = verify_points(shapes, [[90.0, 100.0, 130.0], [39.0, 40.0, 41.0]], per_row_ms=1.8)
    assert min(min(s) for s in points.samples) == 0.0
    points.table("verify")  # valid
