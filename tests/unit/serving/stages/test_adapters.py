"""The Triton-free stage adapters behind the model.py files (no server).

One adapter per stage for the CPU and the GPU models alike: each is tested here once, with CPU
tensors (the GPU models run the same code on cuda).
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest
import torch
from helpers.server import save_tiny_pair

from avspec.av.snapshot import save_snapshot
from avspec.av.step_log import read_step_log
from avspec.config import EstimatorConfig
from avspec.contract import StepInputs
from avspec.engine.draft_stage import DraftStage
from avspec.serving.repository import (
    STEP_INPUT_DTYPES,
    TORCH_DTYPES,
    StageParams,
    VerifierParams,
)
from avspec.serving.stages.adapters import (
    DraftAdapter,
    TargetAdapter,
    VerifierAdapter,
    load_cost_tables,
    load_estimator,
    stage_adapter,
)

K = 4


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_tiny_pair(tmp_path_factory.mktemp("pair"))


def first_step(batch: int = 2) -> dict[str, torch.Tensor]:
    """The step inputs of `batch` new sequences, in the dtypes of the model configs."""
    tensors = {
        name: torch.zeros(batch, dtype=TORCH_DTYPES[dtype])
        for name, dtype in STEP_INPUT_DTYPES.items()
    }
    tensors["seq_ids"] = torch.arange(1, batch + 1)
    tensors["input_ids"] = torch.full((batch, 3), 65, dtype=torch.int32)
    tensors["input_lengths"][:] = 3
    tensors["num_draft_tokens"][:] = K
    tensors["adaptive"][:] = True
    tensors["temperature"][:] = 1.0
    tensors["top_p"][:] = 1.0
    tensors["prev_num_accepted"] = torch.zeros(0, dtype=torch.int32)
    tensors["draft_plan"] = torch.zeros(0)  # no plan yet: every row drafts its cap
    tensors["prev_timing_ms"] = torch.zeros(0)
    tensors["prev_target_features"] = torch.zeros(0, 0)  # a draft model reads no features
    tensors["prev_feature_counts"] = torch.zeros(0, dtype=torch.int32)
    tensors["prev_feature_starts"] = torch.zeros(0, dtype=torch.int32)
    return tensors


def test_cost_tables_missing_file_falls_back_with_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING):
        cost = load_cost_tables(tmp_path / "absent.json")
    assert "linear defaults" in caplog.text
    assert float(cost.verify(100)) > float(cost.draft_pass(100))


def test_cost_tables_from_file_and_malformed(tmp_path: Path) -> None:
    path = tmp_path / "costs.json"
    table = {"sizes": [1, 8], "millis": [1.0, 2.0]}
    path.write_text(
        json.dumps(
            {"format": "avspec-step-cost/1", "overhead_ms": 3.0, "draft_pass": table,
             "verify": table}
        )
    )  # fmt: skip
    cost = load_cost_tables(path)
    assert float(cost.draft_pass(8)) == pytest.approx(2.0) and cost.overhead_ms == 3.0
    path.write_text(json.dumps({"draft_cost": table, "verify_cost": table}))  # the old format
    with pytest.raises(ValueError, match="costs.json"):
        load_cost_tables(path)


def test_load_estimator_missing_corrupt_and_valid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EstimatorConfig(num_positions=K)
    snapshot = tmp_path / "snap.json"
    assert float(load_estimator(config, snapshot, "cpu").slope) == 0.5
    snapshot.write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert float(load_estimator(config, snapshot, "cpu").slope) == 0.5
    assert "ignoring estimator snapshot" in caplog.text
    estimator = load_estimator(config, None, "cpu")
    estimator.slope.fill_(0.7)
    save_snapshot(estimator, snapshot)
    assert float(load_estimator(config, snapshot, "cpu").slope) == pytest.approx(0.7)


def verifier_step(batch: int = 2) -> dict[str, torch.Tensor]:
    return {
        "seq_ids": torch.arange(1, batch + 1),
        "draft_features": torch.ones(batch, K),
        "num_draft_tokens": torch.full((batch,), K, dtype=torch.int32),
        "adaptive": torch.ones(batch, dtype=torch.bool),
        "prev_num_accepted": torch.zeros(0, dtype=torch.int32),
        "release_seq_ids": torch.zeros(0, dtype=torch.int64),
        "input_lengths": torch.full((batch,), 3, dtype=torch.int32),
        "reusable": torch.zeros(batch, dtype=torch.int32),
        "num_drafted": torch.full((batch,), K, dtype=torch.int32),
        "adaptive_drafting": torch.ones(batch, dtype=torch.bool),
        "prev_timing_ms": torch.zeros(0),
    }


def test_invalid_snapshot_is_moved_aside_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A finite double that overflows float32 (slope 1e300) must not become an inf slope that
    no refit can save: the file is reported, moved aside, and the next refit writes a valid one."""
    config = EstimatorConfig(num_positions=K, refit_interval=1)
    snapshot = tmp_path / "snap.json"
    save_snapshot(load_estimator(config, None, "cpu"), snapshot)
    document = json.loads(snapshot.read_text())
    snapshot.write_text(json.dumps({**document, "slope": 1e300}))
    with caplog.at_level(logging.WARNING):
        adapter = VerifierAdapter(config, VerifierParams(snapshot_path="snap.json"), tmp_path)
    assert float(adapter.estimator.slope) == config.initial_slope
    assert str(snapshot) in caplog.text and "slope" in caplog.text
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("snap.json.invalid-")]
    assert len(moved) == 1 and json.loads(moved[0].read_text())["slope"] == 1e300
    assert moved[0].name in caplog.text
    assert not snapshot.exists()
    _, stats = adapter(verifier_step())
    assert stats.refitted
    assert float(load_estimator(config, snapshot, "cpu").slope) == pytest.approx(
        float(adapter.estimator.slope)
    )


def stage_params(model_dir: Path) -> StageParams:
    return StageParams(model_dir=str(model_dir), max_draft_tokens=K, max_sequences=4, max_length=64)


def test_stage_adapters_run_a_step(pair: tuple[Path, Path], tmp_path: Path) -> None:
    target_dir, draft_dir = pair
    draft = stage_adapter("draft", stage_params(draft_dir), tmp_path)
    target = stage_adapter("target", stage_params(target_dir), tmp_path)
    assert isinstance(draft, DraftAdapter) and isinstance(target, TargetAdapter)
    tensors = first_step()
    drafted = draft(tensors)
    assert drafted["draft_tokens"].shape == (2, K)
    assert drafted["draft_tokens"].dtype == torch.int32
    assert drafted["draft_probs"].shape == (2, K, 257)
    assert drafted["draft_features"].dtype == torch.float32
    num_verify = torch.tensor([K, 0], dtype=torch.int32)
    out = target({**tensors, **drafted, "num_verify": num_verify})
    features = {"target_features", "feature_counts", "feature_starts"}
    assert set(out) == {"output_ids", "num_accepted", "target_ms"} | features
    assert all(out[name].numel() == 0 for name in features)  # emit_features is off
    assert drafted["num_drafted"].tolist() == [K, K] and drafted["draft_ms"].shape == (K,)
    assert out["output_ids"].shape == (2, K + 1) and out["output_ids"].dtype == torch.int32
    assert out["num_accepted"][1] == 0
    assert draft.live_sequences == 2 and target.live_sequences == 2


def test_draft_adapter_converts_dtypes_and_returns_the_stage_outputs(
    pair: tuple[Path, Path], tmp_path: Path
) -> None:
    """int64 / float64 inputs become the contract's dtypes; outputs are the stage's own."""
    adapter = DraftAdapter(stage_params(pair[1]), tmp_path)
    tensors = {**first_step(), "temperature": torch.zeros(2)}  # greedy: repeatable
    wide = {name: t.double() if t.is_floating_point() else t.long() for name, t in tensors.items()}
    out = adapter(wide)
    reference = DraftStage(adapter.stage.model, adapter.stage.model.new_cache(4, 64), K)
    want = reference(StepInputs(**tensors))
    assert torch.equal(out["draft_tokens"], want.draft_tokens)
    assert torch.equal(out["draft_probs"], want.draft_probs)
    with pytest.raises(ValueError, match="missing step input.*reusable"):
        adapter({k: v for k, v in tensors.items() if k != "reusable"})


def test_stage_adapter_takes_dtype_and_vocab_limit(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """dtype reaches the weights and the KV cache; vocab_limit masks the rows past it."""
    params = dataclasses.replace(stage_params(pair[1]), dtype="bfloat16", vocab_limit=200)
    adapter = DraftAdapter(params, tmp_path)
    assert adapter.stage.model.embed.weight.dtype == torch.bfloat16
    assert adapter.stage.cache.k.dtype == torch.bfloat16
    drafted = adapter(first_step())
    assert drafted["draft_tokens"].max() < 200
    assert torch.all(drafted["draft_probs"][..., 200:] == 0)
    assert DraftAdapter(stage_params(pair[1]), tmp_path).stage.vocab_limit is None


def test_draft_top_k_reaches_the_draft_only(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """draft_top_k 5: every drafted q has at most 5 tokens; on the target it is refused."""
    params = dataclasses.replace(stage_params(pair[1]), draft_top_k=5)
    drafted = DraftAdapter(params, tmp_path)(first_step())
    assert int((drafted["draft_probs"] > 0).sum(-1).max()) <= 5
    with pytest.raises(ValueError, match="draft_top_k is a parameter of the draft model only"):
        TargetAdapter(dataclasses.replace(stage_params(pair[0]), draft_top_k=5), tmp_path)
    with pytest.raises(ValueError, match="draft_top_k must be >= 0"):
        dataclasses.replace(params, draft_top_k=-1)


def test_stage_adapter_rejects_unknown_stage(pair: tuple[Path, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="stage must be one of"):
        stage_adapter("drafter", StageParams(model_dir=str(pair[1])), tmp_path)


def test_verifier_adapter_counts_refits_and_saves(tmp_path: Path) -> None:
    config = EstimatorConfig(num_positions=K, refit_interval=1)
    params = VerifierParams(cost_tables="", snapshot_path="snap.json")
    adapter = VerifierAdapter(config, params, tmp_path)
    tensors = {
        **verifier_step(),
        "num_draft_tokens": torch.tensor([K, 2], dtype=torch.int32),
        "num_drafted": torch.tensor([K, 2], dtype=torch.int32),
        "adaptive": torch.tensor([True, False]),
    }
    outputs, stats = adapter(tensors)
    verify = outputs["num_verify"]
    assert verify.dtype == torch.int32 and verify[1] == 2  # AV off: every draft verified
    assert stats.batch_size == 2 and stats.drafted == K + 2
    assert stats.drafted == stats.verified + stats.trimmed and stats.refitted
    assert stats.budget_fraction is not None and stats.budget_fraction >= 0
    outputs, stats = adapter({**tensors, "prev_num_accepted": torch.clamp(verify, max=1)})
    assert stats.accepted == int(torch.clamp(verify, max=1).sum())
    assert (tmp_path / "snap.json").is_file()
    slope, intercepts = adapter.coefficients()
    assert len(intercepts) == K and slope > 0


def test_verifier_adapter_reports_no_budget_fraction_without_drafts(tmp_path: Path) -> None:
    adapter = VerifierAdapter(EstimatorConfig(num_positions=K), VerifierParams(), tmp_path)
    zeros = torch.zeros(2, dtype=torch.int32)
    no_drafts = {**verifier_step(), "num_draft_tokens": zeros, "num_drafted": zeros}
    outputs, stats = adapter(no_drafts)
    assert outputs["num_verify"].tolist() == [0, 0]
    assert (stats.drafted, stats.verified, stats.trimmed) == (0, 0, 0)
    assert stats.budget_fraction is None and not stats.refitted


def saved_snapshot(tmp_path: Path, pair_id: str | None) -> tuple[EstimatorConfig, Path]:
    """A snapshot of an estimator with slope 0.7, saved with `pair_id` (None: no pair)."""
    config = EstimatorConfig(num_positions=K)
    snapshot = tmp_path / "snap.json"
    estimator = load_estimator(config, None, "cpu")
    estimator.slope.fill_(0.7)
    if pair_id is None:
        save_snapshot(estimator, snapshot)
    else:
        save_snapshot(estimator, snapshot, pair_id=pair_id)
    return config, snapshot


def test_snapshot_of_another_pair_is_ignored_and_kept(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, snapshot = saved_snapshot(tmp_path, pair_id="pair-a")
    before = snapshot.read_text()
    with caplog.at_level(logging.INFO):
        assert float(load_estimator(config, snapshot, "cpu", "pair-b").slope) == 0.5
    lines = [r.getMessage() for r in caplog.records if "snap.json" in r.getMessage()]
    assert len(lines) == 1 and "pair-a" in lines[0] and "pair-b" in lines[0]
    assert snapshot.read_text() == before
    assert not [p for p in tmp_path.iterdir() if ".invalid-" in p.name]
    restored = load_estimator(config, snapshot, "cpu", "pair-a")
    assert float(restored.slope) == pytest.approx(0.7)


def test_snapshot_without_pair_is_accepted_with_a_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config, snapshot = saved_snapshot(tmp_path, pair_id=None)
    with caplog.at_level(logging.INFO):
        assert float(load_estimator(config, snapshot, "cpu", "pair-b").slope) == pytest.approx(0.7)
    assert "records no pair" in caplog.text and "pair-b" in caplog.text


def test_verifier_adapter_records_its_pair(tmp_path: Path) -> None:
    config = EstimatorConfig(num_positions=K, refit_interval=1)
    params = VerifierParams(snapshot_path="snap.json", pair_id="pair-a")
    adapter = VerifierAdapter(config, params, tmp_path)
    _, stats = adapter(verifier_step())
    assert stats.refitted
    assert json.loads((tmp_path / "snap.json").read_text())["pair"] == "pair-a"


def test_verifier_adapter_writes_the_step_log_a_replay_reads(tmp_path: Path) -> None:
    params = VerifierParams(cost_tables="", step_log="logs/steps.jsonl")
    adapter = VerifierAdapter(EstimatorConfig(num_positions=K), params, tmp_path)
    first = {**verifier_step(), "num_drafted": torch.tensor([K, 3], dtype=torch.int32)}
    outputs, _ = adapter(first)
    timing = torch.arange(K + 2, dtype=torch.float32)
    adapter({**first, "prev_num_accepted": torch.tensor([1, -3]), "prev_timing_ms": timing})
    lines = read_step_log(tmp_path / "logs/steps.jsonl")
    assert [line["ids"] for line in lines] == [[1, 2], [1, 2]]
    assert lines[0]["drafted"] == [K, 3] and [len(f) for f in lines[0]["features"]] == [K, 3]
    assert lines[0]["verify"] == outputs["num_verify"].tolist()
    assert lines[0]["base"] == 6 and lines[0]["prev_accepted"] == [] and lines[0]["timing"] == []
    assert lines[1]["prev_accepted"] == [1, -3] and lines[1]["timing"] == timing.tolist()
    assert lines[0]["t"] <= lines[1]["t"]


def test_step_log_is_off_without_the_parameter(tmp_path: Path) -> None:
    adapter = VerifierAdapter(EstimatorConfig(num_positions=K), VerifierParams(), tmp_path)
    assert adapter.step_log is None
    adapter(verifier_step())
    assert list(tmp_path.iterdir()) == []
