"""client/bench_ragged_verify.py: its verify mixes, its tile rules, and a run end to end on the
tiny pair's target that restores the tile rule it swaps in."""

from __future__ import annotations

import pytest
from helpers.client_scripts import load_client_script
from helpers.server import save_tiny_pair

from avspec.runtime import ragged

pytestmark = pytest.mark.usefixtures("single_thread")

bench = load_client_script("bench_ragged_verify")


def test_verify_mixes_fit_the_rows_and_the_draft_length() -> None:
    for rows in (1, 4, 64):
        mixes = bench.verify_mixes(rows)
        assert mixes["no drafts"] == [0] * rows
        assert mixes["every row x 1 (k1)"] == [1] * rows
        for verify in mixes.values():
            assert len(verify) == rows and all(0 <= v <= bench.K for v in verify)
    assert sum(bench.verify_mixes(64)["6 rows x 1"]) == 6


def test_tile_rules_parse_and_bad_ones_are_named() -> None:
    assert bench.tile_rule("1.25:8") == (1.25, 8)
    for bad in ("1.25", "x:8", "0.5:8", "2:-1"):
        with pytest.raises(ValueError, match="--padding"):
            bench.tile_rule(bad)


def test_a_run_prints_every_mix_under_every_rule_and_restores_the_rule(tmp_path, capsys):
    target, _ = save_tiny_pair(tmp_path / "pair")
    before = (ragged.RaggedIndex.__init__.__defaults__, ragged.tile_groups.__defaults__)
    rule = (ragged.MAX_PADDING, ragged.PAD_SLACK)
    args = ["--target", str(target), "--dtype", "float32", "--rows", "4", "--context", "16",
            "--rounds", "1", "--warmup", "0", "--padding", "2.0:0,1.25:8"]  # fmt: skip
    assert bench.main(args) == 0
    table = capsys.readouterr().out
    assert "tiles 2.0:0 | tiles 1.25:8" in table
    assert table.count("\n| ") == 1 + len(bench.verify_mixes(4))  # header and one row per mix
    assert (ragged.RaggedIndex.__init__.__defaults__, ragged.tile_groups.__defaults__) == before
    assert rule == (ragged.MAX_PADDING, ragged.PAD_SLACK)
