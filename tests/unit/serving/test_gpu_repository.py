"""The GPU model repository: configs parse, tensors wire up, every placeholder is filled.

The GPU deployment is `tritonserver --model-repository=model_repository --model-repository=<filled
model_repository_gpu> --model-config-name=gpu`: a model's configs/gpu.pbtxt wins over its
config.pbtxt (seen with the bundled 2.51 server: absent, config.pbtxt is used). These tests
resolve the configs the same way, parse them with Triton's own ModelConfig protobuf, and check the
ensemble and BLS wiring against the tensor tables of avspec.trtllm.request.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from google.protobuf import text_format
from helpers import ROOT
from helpers.client_scripts import load_client_script
from tritonclient.grpc import model_config_pb2 as mc

from avspec.config import from_parameters
from avspec.serving.stages.gpu_adapters import TrtllmTargetParams
from avspec.serving.stages.triton_model import BACKEND_PARAMETERS
from avspec.trtllm.request import TRTLLM_INPUTS, TRTLLM_OUTPUTS

REPOSITORY = ROOT / "model_repository"
TEMPLATES = ROOT / "model_repository_gpu"
EXAMPLE_VALUES = ROOT / "docker" / "gpu_values.example.json"
GPU_VARIANTS = ("draft", "verifier")
TYPE_OF = {np.int32: "TYPE_INT32", np.int64: "TYPE_INT64", np.float32: "TYPE_FP32",
           np.uint64: "TYPE_UINT64", np.bool_: "TYPE_BOOL"}  # fmt: skip


fill_template = load_client_script("fill_template")


def parse(path: Path) -> mc.ModelConfig:
    return text_format.Parse(path.read_text(), mc.ModelConfig())


def example_values() -> dict[str, str]:
    return json.loads(EXAMPLE_VALUES.read_text())


@pytest.fixture(scope="module")
def filled(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gpu") / "model_repository_gpu"
    fill_template.fill_repository(TEMPLATES, out, example_values())
    return out


def gpu_config(name: str, filled: Path) -> mc.ModelConfig:
    """The config `--model-config-name=gpu` loads for model `name` across both repositories."""
    for directory in (REPOSITORY / name, filled / name):
        for candidate in (directory / "configs" / "gpu.pbtxt", directory / "config.pbtxt"):
            if candidate.is_file():
                return parse(candidate)
    raise AssertionError(f"no model {name!r} in either repository")


def tensors(entries) -> dict[str, tuple[int, tuple[int, ...]]]:
    return {t.name: (t.data_type, tuple(t.dims)) for t in entries}


def params(config: mc.ModelConfig) -> dict[str, str]:
    return {k: v.string_value for k, v in config.parameters.items()}


def test_every_config_parses_and_names_its_directory(filled: Path) -> None:
    paths = [*REPOSITORY.glob("*/config.pbtxt"), *REPOSITORY.glob("*/configs/gpu.pbtxt"),
             *filled.glob("*/config.pbtxt")]  # fmt: skip
    assert len(paths) >= 9
    for path in paths:
        model_dir = path.parent.parent if path.parent.name == "configs" else path.parent
        assert parse(path).name == model_dir.name, path


def test_gpu_only_models_stay_out_of_the_cpu_repository() -> None:
    """The CPU server loads every model of model_repository (--load-model=*)."""
    cpu_models = {p.parent.name for p in REPOSITORY.glob("*/config.pbtxt")}
    gpu_models = {p.parent.name for p in TEMPLATES.glob("*/config.pbtxt")}
    assert gpu_models == {"trtllm_target", "tensorrt_llm"}
    assert not cpu_models & gpu_models
    assert all((p / "config.pbtxt").is_file() for p in REPOSITORY.iterdir() if p.is_dir())


def test_templates_have_placeholders_and_the_filled_copy_none(filled: Path) -> None:
    names = set().union(*(fill_template.placeholders(p.read_text())
                          for p in TEMPLATES.rglob("*.pbtxt")))  # fmt: skip
    assert names == set(example_values())
    for path in [*filled.rglob("*.pbtxt"), *REPOSITORY.rglob("*.pbtxt")]:
        assert "${" not in path.read_text(), path
    assert (filled / "trtllm_target" / "1" / "model.py").is_file()


@pytest.mark.parametrize("name", GPU_VARIANTS)
def test_gpu_variant_keeps_the_tensors_and_moves_to_cuda(name: str) -> None:
    cpu, gpu = (
        parse(REPOSITORY / name / "config.pbtxt"),
        parse(REPOSITORY / name / "configs" / "gpu.pbtxt"),
    )
    assert tensors(gpu.input) == tensors(cpu.input)
    assert tensors(gpu.output) == tensors(cpu.output)
    assert [g.kind for g in gpu.instance_group] == [mc.ModelInstanceGroup.KIND_GPU]
    gpu_params, cpu_params = params(gpu), params(cpu)
    assert gpu_params.pop("FORCE_CPU_ONLY_INPUT_TENSORS") == "no"
    assert gpu_params.pop("device") == "cuda" and cpu_params.pop("device") == "cpu"
    if "engine" in cpu_params:  # llama.cpp's engine is CPU-only: the GPU variant runs torch
        assert gpu_params.pop("engine") == "torch" and cpu_params.pop("engine") == "auto"
    if name == "verifier":  # costs measured on the GPU deployment, not the CPU's (docs/gpu.md)
        assert gpu_params.pop("cost_tables") == "models/cost_tables_gpu.json"
        assert cpu_params.pop("cost_tables") == "host"  # measured by the launcher here
    assert gpu_params == cpu_params
    if name == "draft":  # the draft's own reduced vocabulary when it ships one (not run on a GPU)
        assert gpu_params["draft_vocab"] == "auto"
    assert (REPOSITORY / name / "1" / gpu.default_model_filename).is_file()


def test_step_ensemble_wiring_resolves_on_the_gpu(filled: Path) -> None:
    cpu = parse(REPOSITORY / "speculative_step" / "config.pbtxt")
    ensemble = gpu_config("speculative_step", filled)
    assert tensors(ensemble.input) == tensors(cpu.input)
    assert tensors(ensemble.output) == tensors(cpu.output)
    available = {t.name: t.data_type for t in ensemble.input}
    models = []
    for step in ensemble.ensemble_scheduling.step:
        model = gpu_config(step.model_name, filled)
        models.append(step.model_name)
        inputs = {t.name: t for t in model.input}
        assert set(step.input_map) <= set(inputs), step.model_name
        required = {n for n, t in inputs.items() if not t.optional}
        assert required <= set(step.input_map), (step.model_name, required - set(step.input_map))
        for key, value in step.input_map.items():
            assert available[value] == inputs[key].data_type, (step.model_name, key)
        outputs = {t.name: t.data_type for t in model.output}
        for key, value in step.output_map.items():
            available[value] = outputs[key]
    assert models == ["draft", "verifier", "trtllm_target"]
    for out in ensemble.output:
        assert available[out.name] == out.data_type, out.name


def test_trtllm_target_keeps_the_cpu_target_contract(filled: Path) -> None:
    cpu = parse(REPOSITORY / "target" / "config.pbtxt")
    target = gpu_config("trtllm_target", filled)
    assert tensors(target.input) == tensors(cpu.input)
    assert tensors(target.output) == tensors(cpu.output)
    parsed = from_parameters(TrtllmTargetParams, params(target), ignore=BACKEND_PARAMETERS)
    assert parsed.vocab_size == int(example_values()["vocab_size"])
    draft = params(gpu_config("draft", filled))
    assert parsed.max_draft_tokens == int(draft["max_draft_tokens"])


def test_bls_tensors_match_the_tensorrt_llm_model(filled: Path) -> None:
    target = from_parameters(TrtllmTargetParams, params(gpu_config("trtllm_target", filled)),
                             ignore=BACKEND_PARAMETERS)  # fmt: skip
    engine = gpu_config(target.trtllm_model, filled)
    assert engine.backend == "tensorrtllm" and engine.max_batch_size == 64
    declared = {t.name: t for t in engine.input}
    for name, spec in TRTLLM_INPUTS.items():
        assert name in declared, name
        assert mc.DataType.Name(declared[name].data_type) == TYPE_OF[spec.dtype], name
        assert tuple(declared[name].dims) == spec.dims, name
        assert declared[name].optional == spec.optional, name
    outputs = {t.name: t for t in engine.output}
    for name, spec in TRTLLM_OUTPUTS.items():
        assert mc.DataType.Name(outputs[name].data_type) == TYPE_OF[spec.dtype], name
    engine_params = params(engine)
    assert engine_params["exclude_input_in_output"] == "true"
    assert engine_params["enable_kv_cache_reuse"] == "true"
    assert engine_params["gpt_model_path"] == example_values()["engine_dir"]


def test_fill_refuses_missing_unused_and_unsafe_values(tmp_path: Path) -> None:
    values = example_values()
    missing = {k: v for k, v in values.items() if k != "engine_dir"}
    with pytest.raises(fill_template.TemplateError, match="no value for engine_dir"):
        fill_template.fill_repository(TEMPLATES, tmp_path / "a", missing)
    with pytest.raises(fill_template.TemplateError, match="for no placeholder: typo"):
        fill_template.fill_repository(TEMPLATES, tmp_path / "b", {**values, "typo": "1"})
    with pytest.raises(fill_template.TemplateError, match="holds a quote"):
        fill_template.fill_repository(TEMPLATES, tmp_path / "c", {**values, "engine_dir": 'a"b'})
    assert not any(tmp_path.iterdir()), "nothing is written on failure"
    fill_template.fill_repository(TEMPLATES, tmp_path / "d", values)
    with pytest.raises(fill_template.TemplateError, match="exists"):
        fill_template.fill_repository(TEMPLATES, tmp_path / "d", values)
    fill_template.fill_repository(TEMPLATES, tmp_path / "d", values, force=True)
    with pytest.raises(fill_template.TemplateError, match="must differ"):
        fill_template.fill_repository(TEMPLATES, TEMPLATES, values, force=True)
    with pytest.raises(fill_template.TemplateError, match="no template directory"):
        fill_template.fill_repository(tmp_path / "none", tmp_path / "e", values)


def test_fill_text_and_placeholder_names() -> None:
    assert fill_template.fill_text("a ${x} ${x} b", {"x": "1"}) == "a 1 1 b"
    with pytest.raises(fill_template.TemplateError, match="malformed"):
        fill_template.placeholders("${not a name}")
    with pytest.raises(fill_template.TemplateError, match="bad placeholder name"):
        fill_template.check_values({"a b": "1"})


def test_cli_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    values = tmp_path / "values.json"
    values.write_text(json.dumps(example_values()))
    out = tmp_path / "repo"
    assert fill_template.main(["--output", str(out), "--values", str(values),
                               "--set", "vocab_size=32000"]) == 0  # fmt: skip
    assert 'string_value: "32000"' in (out / "trtllm_target" / "config.pbtxt").read_text()
    assert fill_template.main(["--output", str(tmp_path / "x"), "--set", "engine_dir"]) == 2
    assert "name=value" in capsys.readouterr().err
    assert fill_template.main(["--output", str(tmp_path / "y")]) == 2
    assert fill_template.main(["--list"]) == 0
    assert "engine_dir" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("[1]")
    assert fill_template.main(["--output", str(tmp_path / "z"), "--values", str(bad)]) == 2


@pytest.mark.parametrize("config", ["config.pbtxt", "configs/gpu.pbtxt"])
def test_no_step_output_shadows_an_ensemble_input(config: str) -> None:
    """A step output mapped to the name of an ensemble input never reaches the ensemble's
    outputs (Triton keeps the input): the drafting plan once came back empty every step."""
    ensemble = parse(REPOSITORY / "speculative_step" / config)
    inputs = {t.name for t in ensemble.input}
    produced = [v for step in ensemble.ensemble_scheduling.step for v in step.output_map.values()]
    assert not inputs & set(produced), inputs & set(produced)
    assert len(produced) == len(set(produced))
    assert {t.name for t in ensemble.output} <= set(produced)
