"""This host's cost tables, measured at first start and cached (avspec.serving.host.host_costs)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from helpers import ROOT  # noqa: E402
from helpers.hf_dirs import save_hf_pair  # noqa: E402

from avspec.av.cost_file import load_step_cost  # noqa: E402
from avspec.serving.host import host_costs  # noqa: E402
from avspec.serving.host.host_costs import CostOptions, cost_setup, resolve_host_costs  # noqa: E402
from avspec.serving.host.model_pair import prepare_pair  # noqa: E402
from avspec.serving.repository import copy_repository, read_config_parameters  # noqa: E402

REPOSITORY = ROOT / "model_repository"
# A ladder the tiny pair runs in seconds (its context is 64 positions).
SMALL = ("--context", "8", "--draft-rows", "1,2", "--verify-batch-sizes", "1", "--repeats", "2",
         "--warmup", "0")  # fmt: skip
TORCH = {"draft": {"engine": "torch"}, "target": {"engine": "torch"}}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    draft, target = save_hf_pair(tmp_path_factory.mktemp("hf_pair"))
    return prepare_pair(REPOSITORY, draft, target)


def overrides() -> dict[str, dict[str, object]]:
    return {role: dict(values) for role, values in TORCH.items()}


def test_the_key_follows_threads_engine_and_files(prepared, tmp_path: Path) -> None:
    setup = cost_setup(REPOSITORY, prepared, overrides(), cpu_threads=1)
    assert setup.engine == "torch" and setup.threads == 1 and setup.max_draft_tokens == 8
    assert setup.key() == cost_setup(REPOSITORY, prepared, overrides(), 1).key()
    assert setup.key().startswith("torch-1t-")
    assert cost_setup(REPOSITORY, prepared, overrides(), 2).key() != setup.key()
    weights = setup.files()
    assert weights and all(f.suffix == ".safetensors" for f in weights)
    stat, before = weights[0].stat(), setup.key()
    os.utime(weights[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a new file there
    try:
        assert setup.key() != before
    finally:
        os.utime(weights[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    llama = {role: {"engine": "llamacpp", "threads": "2"} for role in TORCH}
    gguf = cost_setup(REPOSITORY, prepared, llama, cpu_threads=1)
    assert gguf.threads == 2 and [f.name for f in gguf.files()] == ["model.gguf"] * 2
    assert "--engine-threads" in gguf.profile_command(tmp_path / "x.json")
    mixed = {"draft": {"engine": "torch"}, "target": {"engine": "llamacpp"}}
    with pytest.raises(ValueError, match="--cost-tables"):
        cost_setup(REPOSITORY, prepared, mixed, cpu_threads=1)


def test_a_head_beside_a_llamacpp_target_is_keyed_by_its_own_files(tmp_path: Path) -> None:
    """A draft head runs on torch beside a target on llama.cpp's engine: not a mixed pair to
    refuse; its tensors key the tables and its torch threads and dtype reach the profiler."""
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "head.safetensors").write_bytes(b"x")
    setup = host_costs.CostSetup(
        target_dir=tmp_path, draft_dir=tmp_path / "head", engine="llamacpp", target_dtype="auto",
        draft_dtype="auto", precisions="gguf", threads=2, max_draft_tokens=8, draft_top_k=0,
        gguf="model.gguf", flash_attention=True, head=True, head_threads=1,
    )  # fmt: skip
    assert [f.name for f in setup.files()] == ["model.gguf", "head.safetensors"]
    command = setup.profile_command(tmp_path / "x.json")
    assert command[command.index("--engine") + 1] == "llamacpp"
    assert command[command.index("--draft-dtype") + 1] == "auto"
    assert command[command.index("--threads") + 1] == "1"


def test_first_start_measures_then_reuses(prepared, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(host_costs, "LADDER", SMALL)
    given = overrides()
    options = CostOptions(cpu_threads=1, cache=tmp_path / "cache")
    lines = resolve_host_costs(REPOSITORY, prepared, given, options)
    path = Path(str(given["verifier"]["cost_tables"]))
    assert lines == [f"avspec: cost tables of this host measured: {path}"]
    assert path.parent == tmp_path / "cache" and path.name.startswith("torch-1t-")
    cost = load_step_cost(path)  # the verifier's loader takes it
    assert cost.verify.sizes[0] == 1 and cost.overhead_ms == host_costs.OVERHEAD_MS
    measured = json.loads(path.read_text())["measured"]
    assert "-m avspec.tools.bench.profile_costs" in measured["command"] and measured["threads"] == 1
    assert path.with_suffix(".png").is_file()

    def no_measuring(*args, **kwargs):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(host_costs.subprocess, "run", no_measuring)
    again = overrides()
    assert resolve_host_costs(REPOSITORY, prepared, again, options) == [
        f"avspec: cost tables of this host: {path}"
    ]
    assert again["verifier"]["cost_tables"] == str(path)
    with pytest.raises(AssertionError, match="measured again"):
        resolve_host_costs(REPOSITORY, prepared, overrides(), CostOptions(1, options.cache, True))


def test_a_failed_measurement_says_so_and_falls_back(prepared, tmp_path, monkeypatch) -> None:
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    monkeypatch.setattr(host_costs.CostSetup, "profile_command", lambda self, output: fails)
    given = overrides()
    lines = resolve_host_costs(REPOSITORY, prepared, given, CostOptions(1, tmp_path))
    assert "failed (exit 3)" in lines[-1] and "make costs" in lines[-1]
    assert given["verifier"]["cost_tables"] == ""  # the verifier's linear defaults, warned
    assert list(tmp_path.iterdir()) == []


def test_a_named_file_is_left_alone(prepared, tmp_path: Path) -> None:
    given = {**overrides(), "verifier": {"cost_tables": str(tmp_path / "mine.json")}}
    assert resolve_host_costs(REPOSITORY, prepared, given, CostOptions(1, tmp_path)) == []
    assert given["verifier"]["cost_tables"] == str(tmp_path / "mine.json")


def test_host_is_a_word_not_a_path(tmp_path: Path) -> None:
    copy = copy_repository(REPOSITORY, tmp_path / "repo", {})
    params = read_config_parameters((copy / "verifier" / "config.pbtxt").read_text())
    assert params["cost_tables"] == "host"  # not resolved against the root like a path
    assert params["snapshot_path"].startswith("/")


def test_make_costs_measures_and_exits(prepared, tmp_path: Path, monkeypatch, capsys) -> None:
    """`make costs`: the launcher with --remeasure-costs --costs-only, no server started."""
    from avspec.serving.host import launcher

    monkeypatch.setattr(host_costs, "LADDER", SMALL)
    pair = ["--draft-model", str(prepared.draft.directory),
            "--target-model", str(prepared.target.directory)]  # fmt: skip
    common = ["--model-repository", str(REPOSITORY), "--engine", "torch", "--cost-cache",
              str(tmp_path), "--remeasure-costs", "--costs-only"]  # fmt: skip
    assert launcher.main([*common, *pair]) == 0
    out = capsys.readouterr().out
    assert "measuring this host's cost tables (torch" in out
    assert "avspec: serving" not in out and len(list(tmp_path.glob("torch-1t-*.json"))) == 1
    assert launcher.main(common) == 1
    assert "--costs-only needs --draft-model" in capsys.readouterr().err


def test_a_tool_serving_a_copy_gets_the_same_tables(prepared, tmp_path, monkeypatch) -> None:
    """Benchmarks and soaks that start their own ServerProcess resolve `host` like the launcher
    (the pair from the stages' model_dir), so they do not fall back to linear defaults."""
    from avspec.serving.host.host_costs import resolve_for_repository

    monkeypatch.setattr(host_costs, "LADDER", SMALL)
    monkeypatch.setenv(host_costs.CACHE_ENV, str(tmp_path))
    given = {role: {"model_dir": str(getattr(prepared, role).directory)} for role in TORCH}
    lines = resolve_for_repository(REPOSITORY, given)
    assert lines[0].startswith("avspec: engine torch") and "measured" in lines[-1]
    assert given["target"]["engine"] == given["draft"]["engine"] == "torch"
    assert Path(str(given["verifier"]["cost_tables"])).parent == tmp_path
    named = {"verifier": {"cost_tables": "mine.json"}}
    assert resolve_for_repository(REPOSITORY, named) == []
