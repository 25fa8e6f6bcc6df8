"""Triton-free checks of the model repository and its helpers (no server)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import ROOT

from avspec.serving import pbtxt
from avspec.serving.repository import (
    STEP_INPUT_DTYPES,
    EntryParams,
    StageParams,
    copy_repository,
    model_parameters,
    parse_parameters,
    parse_verifier_parameters,
    project_root,
    read_config_parameters,
    resolve_path,
    rewrite_config_parameters,
    step_inputs_from_tensors,
    step_inputs_to_numpy,
    step_outputs_from_numpy,
)

REPOSITORY = ROOT / "model_repository"
TRITON_DTYPES = {np.int64: "INT64", np.int32: "INT32", np.bool_: "BOOL", np.float32: "FP32"}


def config_text(model: str) -> str:
    return (REPOSITORY / model / "config.pbtxt").read_text()


def params_of(model: str) -> dict[str, str]:
    return read_config_parameters(config_text(model))


def test_every_model_has_config_and_adapter() -> None:
    for model in ("draft", "target", "verifier", "speculative"):
        assert (REPOSITORY / model / "1" / "model.py").is_file()
    assert (REPOSITORY / "speculative_step" / "config.pbtxt").is_file()


def test_parameters_parse_and_agree_on_k() -> None:
    draft = parse_parameters(StageParams, params_of("draft"))
    target = parse_parameters(StageParams, params_of("target"))
    estimator, verifier = parse_verifier_parameters(params_of("verifier"))
    entry = parse_parameters(EntryParams, params_of("speculative"))
    assert draft.max_draft_tokens == target.max_draft_tokens == estimator.num_positions
    assert entry.max_draft_tokens == estimator.num_positions
    assert entry.max_context <= min(draft.max_length, target.max_length)
    assert draft.model_dir == "models/draft" and target.model_dir == "models/target"
    assert draft.draft_vocab == "auto" and target.draft_vocab == ""  # the draft's own map, if any
    assert verifier.snapshot_path and verifier.cost_tables
    assert entry.step_model == "speculative_step"


def declared_inputs(model: str) -> dict[str, str]:
    """{name: Triton type without TYPE_} of the inputs of `model`'s config.pbtxt."""
    config = pbtxt.parse(config_text(model))
    return {t.name: pbtxt.type_name(t.data_type).removeprefix("TYPE_") for t in config.input}


@pytest.mark.parametrize("model", ["draft", "target", "speculative_step"])
def test_step_tensors_match_the_contract(model: str) -> None:
    declared = declared_inputs(model)
    for name, dtype in STEP_INPUT_DTYPES.items():
        assert declared[name] == TRITON_DTYPES[dtype], name


def test_verifier_inputs_are_ensemble_tensors() -> None:
    inputs = declared_inputs("verifier")
    assert set(inputs) - set(STEP_INPUT_DTYPES) == {"draft_features", "num_drafted"}


def test_model_parameters_accepts_json_and_dict() -> None:
    block = {"parameters": {"a": {"string_value": "1"}}}
    assert model_parameters('{"parameters": {"a": {"string_value": "1"}}}') == block["parameters"]
    assert model_parameters(block) == block["parameters"]
    assert model_parameters({}) == {}


def test_unfilled_placeholder_and_unknown_key_fail() -> None:
    with pytest.raises(ValueError, match="placeholder"):
        parse_parameters(StageParams, {"model_dir": {"string_value": "${model_dir}"}})
    with pytest.raises(ValueError, match="unknown"):
        parse_parameters(StageParams, {"model_dir": "x", "max_draft": "8"})
    with pytest.raises(ValueError, match="unknown"):
        parse_verifier_parameters({"snapshot": "x"})


@pytest.mark.parametrize("field", ["max_draft_tokens", "max_sequences", "max_length"])
def test_stage_params_reject_non_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        StageParams(model_dir="x", **{field: 0})


@pytest.mark.parametrize("field", ["max_batch_size", "max_context", "max_draft_tokens"])
def test_entry_params_reject_non_positive(field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EntryParams(**{field: 0})


def test_paths_resolve_against_project_root(tmp_path: Path) -> None:
    root = project_root(tmp_path / "model_repository" / "draft")
    assert root == tmp_path.resolve()
    assert resolve_path(root, "models/draft") == root / "models/draft"
    assert resolve_path(root, "/abs/x") == Path("/abs/x")


def _step_arrays(batch: int = 2) -> dict[str, np.ndarray]:
    arrays = {name: np.zeros(batch, dtype=dtype) for name, dtype in STEP_INPUT_DTYPES.items()}
    arrays["input_ids"] = np.arange(batch * 3, dtype=np.int64).reshape(batch, 3)
    arrays["prev_num_accepted"] = np.zeros(0, dtype=np.int32)
    return arrays


def _tensors(arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {name: torch.from_numpy(array) for name, array in arrays.items()}


def test_step_inputs_round_trip() -> None:
    inputs = step_inputs_from_tensors(_tensors(_step_arrays()))
    assert inputs.input_ids.dtype == torch.int32 and inputs.adaptive.dtype == torch.bool
    back = step_inputs_to_numpy(inputs)
    assert back["input_ids"].dtype == np.int32
    np.testing.assert_array_equal(back["input_ids"], _step_arrays()["input_ids"])
    assert back["prev_num_accepted"].shape == (0,)


def test_step_inputs_missing_tensor() -> None:
    arrays = _step_arrays()
    del arrays["reusable"]
    with pytest.raises(ValueError, match="reusable"):
        step_inputs_from_tensors(_tensors(arrays))


def test_step_outputs_from_numpy() -> None:
    out = step_outputs_from_numpy(
        {
            "output_ids": np.zeros((1, 9), dtype=np.int64),
            "num_accepted": np.zeros(1),
            "num_verify": np.zeros(1),
        }
    )
    assert out.output_ids.dtype == torch.int32 and out.num_verify.dtype == torch.int32


def test_rewrite_parameters_overrides_and_absolutises(tmp_path: Path) -> None:
    text = config_text("verifier")
    new = read_config_parameters(
        rewrite_config_parameters(text, {"refit_interval": "10"}, root=tmp_path)
    )
    assert new["refit_interval"] == "10"
    assert new["snapshot_path"] == str(tmp_path / "runs/estimator_snapshot.json")
    with pytest.raises(ValueError, match="refit_every"):
        rewrite_config_parameters(text, {"refit_every": "10"})


def test_copy_repository(tmp_path: Path) -> None:
    copy = copy_repository(REPOSITORY, tmp_path / "repo", {"speculative": {"max_batch_size": 3}})
    assert (
        read_config_parameters((copy / "speculative/config.pbtxt").read_text())["max_batch_size"]
        == "3"
    )
    draft = read_config_parameters((copy / "draft/config.pbtxt").read_text())
    assert Path(draft["model_dir"]).is_absolute()
    assert (copy / "speculative/1/model.py").is_file()
    with pytest.raises(ValueError, match="no such model"):
        copy_repository(REPOSITORY, tmp_path / "other", {"drafter": {}})


def test_every_model_has_a_tracked_version_directory():
    """Git drops empty directories: a clean clone must still hold each model's `1/`."""
    root = REPOSITORY.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "model_repository"], cwd=root, capture_output=True, text=True
    ).stdout.splitlines()
    models = sorted(p.parent.name for p in REPOSITORY.glob("*/config.pbtxt"))
    missing = [
        m for m in models if not any(f.startswith(f"model_repository/{m}/1/") for f in tracked)
    ]
    assert not missing, f"models without a tracked version directory: {missing}"


def test_rewrite_parses_the_config_and_keeps_its_header(tmp_path: Path) -> None:
    text = config_text("target")
    rewritten = rewrite_config_parameters(text, {"max_length": "64"}, root=tmp_path)
    assert rewritten.splitlines()[0] == text.splitlines()[0]
    new, old = pbtxt.parse(rewritten), pbtxt.parse(text)
    assert pbtxt.parameters(new)["max_length"] == "64"
    assert new.input == old.input and new.output == old.output
    with pytest.raises(ValueError, match="not a Triton model config"):
        read_config_parameters('parameters { key: "a" value: { string_value: "1" } } }')


def test_copy_repository_names_a_config_that_does_not_parse(tmp_path: Path) -> None:
    source = tmp_path / "model_repository"
    (source / "m").mkdir(parents=True)
    (source / "m" / "config.pbtxt").write_text("max_batch_size: ${size}\n")
    with pytest.raises(ValueError, match="m/config.pbtxt: not a Triton model config"):
        copy_repository(source, tmp_path / "copy")
