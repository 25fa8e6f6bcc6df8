"""avspec.serving.model_configs: the committed config.pbtxt files are what the contract and the
model declarations generate, and a hand edit that disagrees (a dims, a dtype) is caught."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT

from avspec.contract import STEP_INPUTS, STEP_OUTPUTS, STEP_TENSORS, StepInputs, StepOutputs
from avspec.serving import pbtxt
from avspec.serving.model_configs import (
    COMMAND,
    GeneratedConfig,
    generated_configs,
    main,
    parameters,
    stale_configs,
)
from avspec.serving.repository import EntryParams, StageParams, read_config_parameters

GENERATED = generated_configs()


@pytest.mark.parametrize("generated", GENERATED, ids=lambda g: g.path)
def test_committed_config_is_the_generated_one(generated: GeneratedConfig) -> None:
    committed = (ROOT / generated.path).read_text()
    assert committed == generated.text(), (
        f"{generated.path} differs from what avspec.contract and avspec.serving.model_configs "
        f"generate: change the declaration there, then run `{COMMAND}`"
    )


def test_every_config_of_both_repositories_is_generated() -> None:
    on_disk = {
        str(p.relative_to(ROOT))
        for repository in ("model_repository", "model_repository_gpu")
        for p in (ROOT / repository).rglob("*.pbtxt")
    }
    assert on_disk == {g.path for g in GENERATED}


def copy_of_the_configs(tmp_path: Path) -> Path:
    for generated in GENERATED:
        (tmp_path / generated.path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / generated.path, tmp_path / generated.path)
    return tmp_path


@pytest.mark.parametrize(
    ("path", "old", "new"),
    [
        ("model_repository/target/config.pbtxt", "dims: [-1, -1, -1]", "dims: [-1, -1]"),
        ("model_repository/draft/config.pbtxt", "TYPE_INT64", "TYPE_INT32"),
        ("model_repository/verifier/configs/gpu.pbtxt", '"cuda"', '"cpu"'),
    ],
)
def test_a_hand_edit_is_caught(
    tmp_path: Path, capsys: pytest.CaptureFixture, path: str, old: str, new: str
) -> None:
    root = copy_of_the_configs(tmp_path)
    assert stale_configs(root) == []
    text = (root / path).read_text()
    assert old in text
    (root / path).write_text(text.replace(old, new, 1))
    assert stale_configs(root) == [path]
    assert main(["--check", "--root", str(root)]) == 1
    assert f"{path} differs from what `{COMMAND}` generates" in capsys.readouterr().err
    assert main(["--write", "--root", str(root)]) == 0
    assert stale_configs(root) == []


def test_step_tensors_come_from_the_contract() -> None:
    """Each stage's and the ensemble's tensors have the contract's dtype and rank."""
    types = {torch.int64: "TYPE_INT64", torch.int32: "TYPE_INT32", torch.bool: "TYPE_BOOL",
             torch.float32: "TYPE_FP32"}  # fmt: skip
    for generated in GENERATED:
        config = generated.config
        if config.name in ("speculative", "tensorrt_llm"):
            continue
        for tensor in [*config.input, *config.output]:
            spec = STEP_TENSORS[tensor.name]
            assert pbtxt.type_name(tensor.data_type) == types[spec.dtype], tensor.name
            assert tuple(tensor.dims) == spec.dims == (-1,) * len(spec.shape), tensor.name
    ensemble = pbtxt.parse((ROOT / "model_repository/speculative_step/config.pbtxt").read_text())
    assert [t.name for t in ensemble.input] == [s.name for s in STEP_INPUTS]
    assert [t.name for t in ensemble.output] == [s.name for s in STEP_OUTPUTS]


def test_contract_defaults_follow_the_declared_dtypes() -> None:
    empty = torch.zeros(0)
    inputs = StepInputs(*(empty for spec in STEP_INPUTS[:12]))
    outputs = StepOutputs(empty, empty, empty)
    for holder in (inputs, outputs):
        for name, value in holder.as_dict().items():
            if value is not empty:  # a default
                assert value.dtype == STEP_TENSORS[name].dtype and value.numel() == 0, name


def test_parameters_take_the_dataclass_defaults() -> None:
    entry = read_config_parameters((ROOT / "model_repository/speculative/config.pbtxt").read_text())
    assert entry == parameters(EntryParams, max_context=512)
    assert parameters(StageParams, only=("flash_attention",), model_dir="m") == {
        "flash_attention": "true"
    }
    with pytest.raises(TypeError, match="no default"):
        parameters(StageParams)
    with pytest.raises(TypeError, match="no field"):
        parameters(EntryParams, max_batch=3)


def test_placeholders_render_in_integer_fields() -> None:
    engine = next(g for g in GENERATED if g.config.name == "tensorrt_llm").text()
    assert "max_batch_size: ${triton_max_batch_size}" in engine
    assert "max_queue_delay_microseconds: ${max_queue_delay_microseconds}" in engine
    assert str(pbtxt.STAND_IN_BASE)[:6] not in engine
    with pytest.raises(ValueError, match="placeholder x"):
        pbtxt.render(pbtxt.ModelConfig(name="m"), placeholders={pbtxt.STAND_IN_BASE: "x"})


def test_header_names_the_command_and_every_parameter() -> None:
    for generated in GENERATED:
        text = generated.text()
        assert text.startswith(f"# Generated by `{COMMAND}`"), generated.path
        header = text.split("\nname: ")[0]
        for key in generated.config.parameters:
            assert f"#   {key}: " in header, (generated.path, key)
