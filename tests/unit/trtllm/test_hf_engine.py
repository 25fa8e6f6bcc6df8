"""avspec.trtllm.hf_engine: the stock TensorRT-LLM converter per architecture and the
`trtllm-build` command (no TensorRT-LLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import text_format
from helpers import ROOT
from tritonclient.grpc import model_config_pb2 as mc

from avspec.trtllm.hf_engine import (
    BUILD_FLAGS,
    MAX_DRAFT_LEN,
    ExportError,
    build_command,
    build_engine,
    convert_command,
    main,
)


@pytest.mark.parametrize(
    ("architecture", "family"),
    [("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "llama"), ("Qwen2ForCausalLM", "qwen")],
)
def test_convert_command_uses_the_stock_example(architecture: str, family: str) -> None:
    command = convert_command(architecture, "/m", "/ckpt", "/ex", "bfloat16")
    assert command == [
        "python3", f"/ex/{family}/convert_checkpoint.py",
        "--model_dir", "/m", "--output_dir", "/ckpt", "--dtype", "bfloat16",
    ]  # fmt: skip


def test_tensor_parallel_conversion_splits_the_weights() -> None:
    """TP > 1: the stock converter splits the weights N ways with N workers; TP 1 adds nothing."""
    command = convert_command("LlamaForCausalLM", "/m", "/ckpt", "/ex", "float16", tp_size=4)
    assert command[-4:] == ["--tp_size", "4", "--workers", "4"]
    assert "--tp_size" not in convert_command("LlamaForCausalLM", "/m", "/ckpt", "/ex")
    with pytest.raises(ExportError, match="tp_size"):
        convert_command("LlamaForCausalLM", "/m", "/ckpt", "/ex", tp_size=0)


def test_convert_command_refuses_unknown_architecture_and_dtype() -> None:
    with pytest.raises(ExportError, match="no TensorRT-LLM converter"):
        convert_command("GPT2LMHeadModel", "/m", "/c", "/ex")
    with pytest.raises(ExportError, match="dtype"):
        convert_command("LlamaForCausalLM", "/m", "/c", "/ex", "int8")


def test_main_stops_before_converting_without_the_examples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from helpers.hf_dirs import TINY_LLAMA

    model = tmp_path / "hf"
    model.mkdir()
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, **TINY_LLAMA}
    (model / "config.json").write_text(json.dumps(config))
    argv = [str(model), "--out", str(tmp_path / "c"), "--build", str(tmp_path / "e")]
    assert main([*argv, "--examples", str(tmp_path / "none"), "--max-seq-len", "128"]) == 2
    assert "TRTLLM_EXAMPLES" in capsys.readouterr().err
    assert main([*argv, "--examples", str(tmp_path), "--max-seq-len", "4096"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_build_command_carries_the_deployment_flags(tmp_path: Path) -> None:
    cmd = build_command(tmp_path / "ckpt", tmp_path / "engine", 32, 256, 8, "float16")
    assert cmd[0] == "trtllm-build"
    flags = {flag: cmd[i + 1] for i, flag in enumerate(cmd[:-1]) if cmd[i + 1][:2] != "--"}
    assert flags["--checkpoint_dir"] == str(tmp_path / "ckpt")
    assert flags["--output_dir"] == str(tmp_path / "engine")
    assert flags["--speculative_decoding_mode"] == "draft_tokens_external"
    assert flags["--max_draft_len"] == "8" and flags["--max_batch_size"] == "32"
    assert (flags["--max_input_len"], flags["--max_seq_len"]) == ("255", "256")
    assert flags["--gemm_plugin"] == "float16"
    assert all(flag in cmd for flag in BUILD_FLAGS)
    for bad in ({"max_batch_size": 0}, {"max_seq_len": 1}, {"max_draft_len": True}):
        with pytest.raises(ExportError, match=next(iter(bad))):
            build_command("c", "e", **bad)


def test_default_draft_len_covers_the_repository_k() -> None:
    for model in ("draft", "target", "speculative"):
        path = ROOT / "model_repository" / model / "config.pbtxt"
        config = text_format.Parse(path.read_text(), mc.ModelConfig())
        assert int(config.parameters["max_draft_tokens"].string_value) <= MAX_DRAFT_LEN


def test_build_engine_reports_a_failing_build(tmp_path: Path, monkeypatch) -> None:
    fake = tmp_path / "bin" / "trtllm-build"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    with pytest.raises(ExportError, match="exit status 3"):
        build_engine(["trtllm-build", "--checkpoint_dir", "x"])


def test_main_refuses_the_retired_format_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "config.json").write_text(json.dumps({"format": "avspec-transformer", "version": 1}))
    argv = [str(old), "--out", str(tmp_path / "c"), "--build", str(tmp_path / "e")]
    assert main([*argv, "--examples", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(old) in err and "retired format" in err and "Hugging Face" in err
    assert not (tmp_path / "c").exists()
