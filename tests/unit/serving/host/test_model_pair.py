"""The launcher's pair check before tritonserver starts (avspec.serving.host.model_pair), no
server."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from helpers import ROOT  # noqa: E402
from helpers.hf_dirs import (  # noqa: E402
    TINY_LLAMA,
    save_hf_pair,
    tiny_llama,
    tiny_tokenizer,
)

from avspec.runtime.model_dir import ModelDirError  # noqa: E402
from avspec.runtime.pair import PairError  # noqa: E402
from avspec.runtime.precision import auto_dtype  # noqa: E402
from avspec.serving.host import launcher, serve  # noqa: E402
from avspec.serving.host.cli import parse_args  # noqa: E402
from avspec.serving.host.model_pair import (  # noqa: E402
    pair_identity,
    prepare_pair,
    shared_pool_overrides,
)
from avspec.serving.host.served_repository import head_overrides, prepare_repository  # noqa: E402
from avspec.serving.host.settings import ServeSettings  # noqa: E402
from avspec.serving.repository import StageParams, read_config_parameters  # noqa: E402

REPOSITORY = ROOT / "model_repository"
MAX_POSITIONS = TINY_LLAMA["max_position_embeddings"]


def stage_settings(*options: str) -> dict[str, dict[str, str]]:
    """The stages' overrides the launcher's settings make of `options`."""
    args = parse_args(["--model-repository", str(REPOSITORY), *options])
    return ServeSettings.from_args(args, {}).stage_settings()


def change_one_token(directory: Path) -> Path:
    """Rename the byte token of 0x00 (unused by the corpus, so in no merge) in tokenizer.json."""
    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["<renamed>"] = vocab.pop("\u0100")
    path.write_text(json.dumps(data))
    return directory


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return save_hf_pair(tmp_path_factory.mktemp("hf_pair"))


def test_prepare_pair_describes_caps_and_overrides(pair: tuple[Path, Path]) -> None:
    draft, target = pair
    prepared = prepare_pair(REPOSITORY, draft, target)
    tokens = tiny_tokenizer().get_vocab_size()
    assert prepared.info.num_tokens == tokens and prepared.info.padded
    for role, directory, summary in (
        ("draft", draft, prepared.draft),
        ("target", target, prepared.target),
    ):
        assert prepared.overrides[role] == {
            "model_dir": str(directory.resolve()),
            "max_length": str(MAX_POSITIONS),
            "vocab_limit": str(tokens),
        }
        hf = tiny_llama(tokens + 8, seed=3)
        assert summary.num_parameters == sum(p.numel() for p in hf.parameters())
        element = auto_dtype().itemsize  # the repository's dtype is auto
        kv = 2 * TINY_LLAMA["num_hidden_layers"] * TINY_LLAMA["num_key_value_heads"] * 16 * element
        assert summary.kv_bytes_per_token == kv
        assert summary.kv_cache_bytes == summary.max_sequences * MAX_POSITIONS * kv
        line = summary.line()
        served = str(auto_dtype()).removeprefix("torch.")
        assert line.startswith(
            f"avspec: {role} {directory.resolve()}: LlamaForCausalLM, {served} (auto),"
        )
        assert f"{summary.num_parameters:,} parameters" in line and "KV cache" in line
    assert prepared.overrides["speculative"] == {"max_context": str(MAX_POSITIONS)}
    assert prepared.overrides["verifier"] == {"pair_id": pair_identity(draft, target)}
    caps = [line for line in prepared.lines if "capped" in line]
    assert len(caps) == 3 and all(f"capped at {MAX_POSITIONS}" in c for c in caps)


@pytest.mark.parametrize("engine", ["torch", "llamacpp"])
def test_either_engine_serves_the_pairs_own_context_over_one_pool(
    pair: tuple[Path, Path], engine: str
) -> None:
    prepared = prepare_pair(REPOSITORY, *pair)
    overrides = {stage: dict(values) for stage, values in prepared.overrides.items()}
    for stage in ("draft", "target"):
        overrides[stage]["engine"] = engine
    lines = shared_pool_overrides(REPOSITORY, prepared, overrides)
    where = "torch" if engine == "torch" else "llama.cpp"
    for role in ("draft", "target"):
        slots = int(read_config_parameters((REPOSITORY / role / "config.pbtxt").read_text())[
            "max_sequences"])  # fmt: skip
        pool = slots * MAX_POSITIONS  # the cells the capped slots reserved
        assert overrides[role]["max_length"] == str(MAX_POSITIONS)
        assert overrides[role]["kv_pool_tokens"] == str(pool)
        assert any(line.startswith(f"avspec: {role} on {where}: one KV pool of {pool:,} cells")
                   for line in lines), lines  # fmt: skip
    assert overrides["speculative"]["max_context"] == str(MAX_POSITIONS)


def test_default_pair_is_not_capped() -> None:
    prepared = prepare_pair(REPOSITORY)
    assert len(prepared.lines) == 2
    assert prepared.overrides["draft"]["vocab_limit"] == str(prepared.info.num_tokens)


def test_a_retired_format_pair_is_refused_by_name(tmp_path: Path, pair) -> None:
    draft, target = pair
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"format": "avspec-transformer", "version": 1}))
    for chosen in (
        {"draft_dir": old, "target_dir": target},
        {"draft_dir": draft, "target_dir": old},
    ):
        with pytest.raises(ModelDirError, match=f"{old}: .*retired format"):
            prepare_pair(REPOSITORY, **chosen)


def test_pair_identity_follows_config_and_tokenizer(tmp_path: Path, pair) -> None:
    draft, target = pair
    assert pair_identity(draft, target) == pair_identity(draft, target)
    other = tmp_path / "other"
    other.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (other / name).write_bytes((target / name).read_bytes())
    assert pair_identity(draft, other) == pair_identity(draft, target)
    (other / "tokenizer.json").write_text((target / "tokenizer.json").read_text() + " ")
    assert pair_identity(draft, other) != pair_identity(draft, target)


def test_mismatched_pair_fails_before_any_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    draft, target = save_hf_pair(tmp_path)
    change_one_token(draft)
    with pytest.raises(PairError, match="do not share a vocabulary: token id"):
        prepare_pair(REPOSITORY, draft, target)

    def no_server(*args, **kwargs):
        raise AssertionError("tritonserver must not start for a bad pair")

    monkeypatch.setattr(serve, "ServerProcess", no_server)
    argv = ["--model-repository", str(REPOSITORY), "--draft-model", str(draft)]
    code = launcher.main([*argv, "--target-model", str(target)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert f"draft {draft.resolve()} and target {target.resolve()}" in err[0]
    assert "token id" in err[0]


def test_launcher_serves_a_rewritten_copy(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    draft, target = pair
    copy = prepare_repository(REPOSITORY, draft, target, tmp_path)
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "capped" in out
    params = read_config_parameters((copy / "target" / "config.pbtxt").read_text())
    assert params["model_dir"] == str(target.resolve())
    assert params["max_length"] == str(MAX_POSITIONS)
    assert params["dtype"] == "auto"  # the repository's, kept
    entry = read_config_parameters((copy / "speculative" / "config.pbtxt").read_text())
    assert entry["max_context"] == str(MAX_POSITIONS)
    assert REPOSITORY.joinpath("target", "config.pbtxt").read_text().count(str(target)) == 0


def test_launcher_sets_the_stage_dtypes_it_is_given(
    pair: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    draft, target = pair
    settings = stage_settings("--target-dtype", "w8a8")
    assert settings == {"target": {"dtype": "w8a8"}}
    copy = prepare_repository(REPOSITORY, draft, target, tmp_path / "a", settings)
    assert "target stage dtype w8a8" in capsys.readouterr().out
    params = read_config_parameters((copy / "target" / "config.pbtxt").read_text())
    assert params["dtype"] == "w8a8" and params["model_dir"] == str(target.resolve())
    draft_params = read_config_parameters((copy / "draft" / "config.pbtxt").read_text())
    assert draft_params["dtype"] == "auto"  # not given: the repository's
    # a dtype alone (no pair given) still rewrites a copy
    alone = prepare_repository(REPOSITORY, None, None, tmp_path / "b", {"draft": {"dtype": "int4"}})
    assert read_config_parameters((alone / "draft" / "config.pbtxt").read_text())["dtype"] == "int4"
    gpu = stage_settings("--target-dtype", "float16")
    assert gpu == {"target": {"dtype": "float16"}}  # the GPU launcher
    with pytest.raises(SystemExit):
        parse_args(["--model-repository", str(REPOSITORY), "--target-dtype", "int2"])
    assert stage_settings("--engine", "llamacpp") == {
        "target": {"engine": "llamacpp"},
        "draft": {"engine": "llamacpp"},
    }
    with pytest.raises(SystemExit):
        parse_args(["--model-repository", str(REPOSITORY), "--engine", "onnx"])
    capsys.readouterr()


def test_a_draft_head_runs_on_torch_and_the_engine_setting_names_the_target() -> None:
    overrides = stage_settings("--engine", "llamacpp")
    assert "the head on torch" in head_overrides(overrides)
    assert overrides == {"draft": {"engine": "torch"},
                         "target": {"engine": "llamacpp", "emit_features": "true"}}  # fmt: skip
    overrides = {}
    head_overrides(overrides)
    assert overrides == {"draft": {"engine": "torch"}, "target": {"emit_features": "true"}}


def test_stage_dtype_by_device() -> None:
    assert StageParams(model_dir="x", dtype="bfloat16").dtype == "bfloat16"
    assert StageParams(model_dir="x", device="cuda", dtype="float16").dtype == "float16"
    for name in ("auto", "int8", "int4", "w8a8"):  # avspec.runtime.precision
        assert StageParams(model_dir="x", dtype=name).dtype == name
    with pytest.raises(
        ValueError, match="dtype must be one of float32, bfloat16, auto, int8, int4, w8a8 on cpu"
    ):
        StageParams(model_dir="x", dtype="float16")
    for name in ("int4", "w8a8"):
        with pytest.raises(ValueError, match=f"dtype must be one of .* on cuda, got '{name}'"):
            StageParams(model_dir="x", device="cuda", dtype=name)
    with pytest.raises(ValueError, match="vocab_limit"):
        StageParams(model_dir="x", vocab_limit=-1)
    assert getattr(torch, StageParams(model_dir="x").dtype) is torch.float32


def test_a_requantized_target_needs_llamacpps_engine() -> None:
    from avspec.serving.host.model_pair import check_target_gguf

    quantized = {"gguf": "model.Q4_0.gguf"}
    with pytest.raises(ValueError, match="llama.cpp's engine only.*'torch'"):
        check_target_gguf(REPOSITORY, {"target": {**quantized, "engine": "torch"}})
    check_target_gguf(REPOSITORY, {"target": {**quantized, "engine": "llamacpp"}})
    check_target_gguf(REPOSITORY, {"target": {"engine": "torch"}})  # the published file: any


def test_the_gguf_and_attention_parameters_can_be_overridden(tmp_path: Path) -> None:
    """`make serve QUANT=Q4_0` overrides the target's gguf: each stage config must list it."""
    from avspec.serving.repository import copy_repository

    given = {"gguf": "model.Q4_0.gguf", "flash_attention": "false"}
    copy = copy_repository(REPOSITORY, tmp_path / "repo", {"target": given, "draft": given})
    for stage in ("target", "draft"):
        params = read_config_parameters((copy / stage / "config.pbtxt").read_text())
        assert {k: params[k] for k in given} == given
