"""client/bench_serving.py without a server: arm parsing, outputs from constructed points."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script

bench = load_client_script("bench_serving")


def test_parse_arms():
    arms = bench.parse_arms("default", 3)
    assert [a.name for a in arms] == ["none", "k1", "k2", "k3", "av3", "ad3"]
    assert arms[0].num_draft_tokens == 0 and arms[-1].adaptive and not arms[1].adaptive
    assert arms[-1].drafting and not arms[-2].drafting and arms[-2].adaptive
    assert [a.num_draft_tokens for a in bench.parse_arms("k2, av1", 3)] == [2, 1]
    for bad in ("k0", "k4", "x2", "av", "ad0", "k2,k2"):
        with pytest.raises(ValueError):
            bench.parse_arms(bad, 3)


def test_parse_args_errors(tmp_path: Path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--arms", "k9"])
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--concurrency", "0"])
    args = bench.parse_args(["--out", str(tmp_path), "--concurrency", "4,1,4"])
    assert args.concurrency == [1, 4] and len(args.arm_list) == 11
    assert args.target_dtype is None  # the repository's own
    assert (
        bench.parse_args(["--out", str(tmp_path), "--target-dtype", "int4"]).target_dtype == "int4"
    )
    with pytest.raises(SystemExit):
        bench.parse_args(["--out", str(tmp_path), "--target-dtype", "int3"])
    assert args.draft_dtype is None
    draft = bench.parse_args(["--out", str(tmp_path), "--draft-dtype", "w8a8"])
    assert draft.draft_dtype == "w8a8" and draft.target_dtype is None


def point(c, arm, x, y):
    return {
        "workload": "code", "concurrency": c, "arm": arm, "tokens_per_s_per_user": x,
        "output_tokens_per_s": y, "ttft_ms_median": 5.0, "itl_ms_median": 1.0,
        "itl_ms_p99": 2.0, "accepted_per_pass": 1.5,
    }  # fmt: skip


def test_write_outputs(tmp_path: Path):
    args = bench.parse_args(
        ["--out", str(tmp_path), "--arms", "none,k2,av2", "--workloads", "code"]
    )  # noqa: E501
    arms = bench.take_arms(args)
    points = [
        point(1, "none", 10, 10), point(1, "k2", 12, 12), point(1, "av2", 12, 12.5),
        point(4, "none", 4, 20), point(4, "k2", 5, 30), point(4, "av2", 6, 40),
    ]  # fmt: skip
    bench.mark_frontier(points)
    text = bench.write_outputs(tmp_path, args, arms, points)
    assert "concurrency 1: on the frontier: av2" in text
    assert "av2 on the frontier at 2 of 2" in text
    goals = json.loads((tmp_path / "points.json").read_text())["goals"]["code"]["av2"]
    assert goals["av_over_best_fixed"] == pytest.approx({"1": 12.5 / 12, "4": 40 / 30})
    assert (tmp_path / "frontier_code.png").stat().st_size > 1000
    assert (tmp_path / "points.csv").read_text().count("\n") == 7


class _CharTokenizer:
    """One token per character: enough to count."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def test_load_prompts_skips_prompts_that_leave_no_room(tmp_path: Path):
    prompts = ["a" * 3, "b" * 9, "c" * 5, "d" * 2]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    assert bench.load_prompts(tmp_path, "chat", 2) == ["aaa", "ccccc"]  # spread over the file
    fitting = bench.load_prompts(tmp_path, "chat", 8, 5, _CharTokenizer())
    assert fitting == ["aaa", "ccccc", "dd"]  # the 9-token prompt skipped
    with pytest.raises(SystemExit, match="no prompt of at most 1 tokens"):
        bench.load_prompts(tmp_path, "chat", 8, 1, _CharTokenizer())
