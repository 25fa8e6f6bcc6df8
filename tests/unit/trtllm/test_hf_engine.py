"""avspec.trtllm.hf_engine: the stock TensorRT-LLM converter per architecture (no TensorRT-LLM)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from avspec.trtllm.checkpoint import ExportError
from avspec.trtllm.hf_engine import convert_command, main


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
