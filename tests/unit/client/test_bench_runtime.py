"""client/bench_runtime.py without a model: variant parsing, sources, the table's ratios."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script

bench = load_client_script("bench_runtime")


def test_variants_parse_label_source_precision_and_options():
    v = bench.Variant.parse("int4 g64=rev:abc123:int4+g64+compile")
    assert (v.label, v.source, v.precision, v.options) == (
        "int4 g64",
        "rev:abc123",
        "int4",
        ("g64", "compile"),
    )
    assert bench.Variant.parse("x=/tmp/a:b/backend:float32").source == "/tmp/a:b/backend"
    with pytest.raises(ValueError, match="LABEL=SOURCE:PRECISION"):
        bench.Variant.parse("bf16=worktree")


def test_sources(tmp_path: Path):
    assert bench.source_path("worktree", tmp_path) == bench.ROOT / "backend"
    assert bench.source_path("/somewhere/backend", tmp_path) == Path("/somewhere/backend")


def test_table_ratios_are_to_the_reference():
    a, b = bench.Variant("a", "worktree", "bfloat16"), bench.Variant("b", "worktree", "int4")
    a.times_ms = {"1x1": [10.0, 30.0, 20.0]}
    b.times_ms = {"1x1": [5.0, 6.0, 40.0]}
    assert "| b | 6.0 (0.30) |" in bench.speed_table([a, b], a)
    assert "| b | 5.0 (0.50) |" in bench.speed_table([a, b], a, min)
