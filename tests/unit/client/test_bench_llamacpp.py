"""client/bench_llamacpp.py: arguments, the questions, the ratio maths and table on fixed
figures, the host's CPU flags, the server program's imports and, where the xllamacpp venv
exists, one real chat request to llama.cpp's server on the tiny SmolLM2 GGUF."""

from __future__ import annotations

import ast
import json
import math
import sys
import time
from pathlib import Path

import openai
import pytest
from helpers import ROOT
from helpers.client_scripts import load_client_script

load_client_script("bench_openai")  # imported by name by bench_llamacpp
bench = load_client_script("bench_llamacpp")

XLLAMACPP_PYTHON = ROOT / "build" / "xllamacpp-venv" / "bin" / "python"
TINY_GGUF = ROOT / "build" / "gguf-cache" / "downloads" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_parse_args_defaults_and_lists():
    args = bench.parse_args(["--start-project", "torch, llamacpp"])
    assert args.engines == ["torch", "llamacpp"] and args.project_url is None
    assert args.concurrency == [1, 16, 64] and args.slots == 64 and args.ctx_per_slot == 1024
    assert (args.max_tokens, args.temperature, args.top_p) == (128, 0.7, 0.95)
    assert not args.flash_attn and not args.llama_cache_prompt and args.llama_draft is None
    assert args.threads >= 1 and args.gguf == ROOT / "models" / "target" / "model.gguf"
    greedy = bench.parse_args(["--project-url", "http://h:1", "--greedy", "--concurrency", "4,1,4"])
    assert greedy.temperature == 0.0 and greedy.concurrency == [1, 4] and greedy.engines == []


@pytest.mark.parametrize(
    "argv",
    [
        [],  # a project side is required
        ["--project-url", "u", "--start-project", "torch"],
        ["--project-url", "u", "--concurrency", "0"],
        ["--project-url", "u", "--concurrency", "x"],
        ["--project-url", "u", "--slots", "0"],
        ["--project-url", "u", "--requests", "-1"],
        ["--start-project", ","],
    ],
)
def test_parse_args_errors(argv: list[str]):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)


def test_missing_venv_is_a_clear_error(tmp_path: Path, capsys):
    code = bench.main(["--project-url", "u", "--llama-python", str(tmp_path / "nope")])
    assert code == 1 and "pip install xllamacpp==" in capsys.readouterr().err


def test_requests_per_level_and_round_plan():
    args = bench.parse_args(["--project-url", "u"])
    assert [bench.requests_for(args, c) for c in (1, 16, 64)] == [16, 64, 256]
    args.requests = 10
    assert bench.requests_for(args, 64) == 10
    assert bench.round_plan(3) == [
        (0, True),
        (0, False),
        (1, False),
        (1, True),
        (2, True),
        (2, False),
    ]


def test_load_questions_takes_the_user_message(tmp_path: Path):
    lines = [
        {"prompt": f"<rendered {i}>", "messages": [{"role": "user", "content": f"q{i}"}]}
        for i in range(4)
    ]
    lines[1]["messages"].insert(0, {"role": "system", "content": "s"})
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    assert bench.load_questions(path, 2) == ["q0", "q2"]
    assert bench.load_questions(path, 9) == ["q0", "q1", "q2", "q3"]
    shipped = bench.load_questions(ROOT / "workloads" / "chat.jsonl", 64)
    assert len(shipped) == 64 and not any("<|im_start|>" in q for q in shipped)


def test_client_args_are_what_bench_openai_reads():
    args = bench.parse_args(["--project-url", "u", "--max-tokens", "9", "--seed", "5"])
    ns = bench.client_args(args, "m")
    assert (ns.endpoint, ns.model, ns.max_tokens, ns.seed, ns.same_seed) == (
        "chat",
        "m",
        9,
        5,
        False,
    )
    assert ns.extra_body == {} and ns.temperature == 0.7


def phase(pairing, side, round_index, concurrency, tok_s, per_user=10.0, ttft=100.0, errors=0):
    summary = {
        "requests": 4,
        "errors": errors,
        "empty": 0,
        "output_tokens_per_s": tok_s,
        "tokens_per_s_per_user_median": per_user,
        "ttft_ms_median": ttft,
        "output_tokens_mean": 100.0,
    }
    return {"pairing": pairing, "side": side, "round": round_index, "concurrency": concurrency,
            "summary": summary, "records": []}  # fmt: skip


FIXED = [  # llama.cpp 100 / 120 tok/s at c1 and 400 / 500 at c16; the project 60 / 84, 600 / 900
    phase("avspec", bench.LLAMA, 0, 1, 100.0),
    phase("avspec", bench.LLAMA, 1, 1, 120.0, ttft=300.0),
    phase("avspec", "avspec", 0, 1, 60.0, per_user=5.0),
    phase("avspec", "avspec", 1, 1, 84.0, per_user=7.0),
    phase("avspec", bench.LLAMA, 0, 16, 400.0),
    phase("avspec", bench.LLAMA, 1, 16, 500.0, errors=1),
    phase("avspec", "avspec", 0, 16, 600.0),
    phase("avspec", "avspec", 1, 16, 900.0),
]


def test_ratio_rows_on_fixed_figures():
    low, high = bench.ratio_rows(FIXED, "avspec")
    assert low["concurrency"] == 1 and high["concurrency"] == 16
    assert low["llama_tokens_per_s"] == pytest.approx(110.0)  # median of two rounds
    assert low["project_tokens_per_s"] == pytest.approx(72.0)
    assert low["ratio"] == pytest.approx(72.0 / 110.0)
    assert (low["ratio_min"], low["ratio_max"]) == pytest.approx((0.6, 0.7))  # 60/100, 84/120
    assert low["project_per_user"] == pytest.approx(6.0) and low["llama_ttft_ms"] == 200.0
    assert high["ratio"] == pytest.approx(750.0 / 450.0)
    assert (high["ratio_min"], high["ratio_max"]) == pytest.approx((1.5, 1.8))
    assert (high["llama_errors"], high["project_errors"]) == (1, 0)


def test_ratio_rows_without_figures_is_nan():
    empty = [{**p, "summary": {"requests": 0, "errors": 4, "empty": 0}} for p in FIXED[:4]]
    (row,) = bench.ratio_rows(empty, "avspec")
    assert math.isnan(row["ratio"]) and math.isnan(row["ratio_min"])
    assert row["llama_errors"] == 8


def test_table_and_summary_text():
    args = bench.parse_args(["--project-url", "u", "--threads", "8", "--slots", "16"])
    rows = {"avspec": bench.ratio_rows(FIXED, "avspec")}
    info = {
        "llama": {"xllamacpp": "2026.10.11549", "n_ctx": 16384},
        "host": {"model": "Some CPU", "cpus": 8, "flags": ["avx2", "avx512f"]},
        "questions": ["q"] * 64,
        "prompt_tokens": {"avspec": {bench.LLAMA: 31, "avspec": 31}},
        "projects": {"avspec": {"command": ["py", "-m", "launcher", "--engine", "torch"]}},
    }
    text = bench.summary_text(args, info, rows)
    assert "avspec: --engine torch" in text
    assert "xllamacpp 2026.10.11549, 8 threads, 16 slots, n_ctx 16384" in text
    assert "flash attention off" in text and "prompt tokens of question 0: the same" in text
    assert "Some CPU, 8 CPUs, avx2 avx512f" in text
    lines = text.splitlines()
    first = next(line for line in lines if line.split()[:1] == ["1"])
    assert first.split()[:5] == ["1", "110.0", "72.0", "0.65", "0.60-0.70"]
    assert next(line for line in lines if line.split()[:1] == ["16"]).split()[-1] == "1/0"
    info["prompt_tokens"]["avspec"]["avspec"] = 30
    assert "DIFFER" in bench.summary_text(args, info, rows)


def test_write_outputs(tmp_path: Path):
    args = bench.parse_args(["--project-url", "u", "--out", str(tmp_path)])
    info = {
        "settings": bench.settings(args),
        "host": {"model": "c", "cpus": 1, "flags": []},
        "versions": {"project": "x"},
        "questions": ["q"],
        "projects": {"avspec": {"url": "u"}},
        "prompt_tokens": {"avspec": {}},
        "llama": {"xllamacpp": "v"},
    }
    bench.write_outputs(args, info, FIXED)
    names = {p.name for p in tmp_path.iterdir()}
    assert {"llamacpp_c1.json", "avspec_c16.json", "summary.txt", "results.json"} <= names
    assert "tokens_per_s.png" in names and "records.jsonl" in names
    level = json.loads((tmp_path / "llamacpp_c16.json").read_text())
    assert level["figures"]["output_tokens_per_s"]["median"] == pytest.approx(450.0)
    assert level["threads"] == args.threads and level["slots"] == 64 and level["host"]["model"]


CPUINFO = """processor\t: 0
model name\t: Fancy CPU
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512_bf16 amx_tile amx_int8

processor\t: 1
model name\t: Fancy CPU
flags\t\t: fpu sse2 avx avx2 fma f16c avx512f amx_tile amx_int8
"""


def test_cpu_info_reads_every_cpu():
    info = bench.cpu_info(CPUINFO)
    assert info["model"] == "Fancy CPU" and info["cpus"] == 2
    # flags every CPU has (avx512_bf16 only on cpu 0)
    assert info["flags"] == ["amx_int8", "amx_tile", "avx", "avx2", "avx512f", "f16c", "fma"]


def test_project_command():
    args = bench.parse_args(["--start-project", "llamacpp", "--project-arg=--cpu-threads=4"])
    command = bench.project_command(args, "llamacpp", [1, 2, 3])
    assert command[:3] == [sys.executable, "-m", "avspec.serving.host.launcher"]
    text = " ".join(command)
    assert "--engine llamacpp" in text and "--http-port 1 --grpc-port 2 --metrics-port 3" in text
    assert command[-1] == "--cpu-threads=4"
    assert command[command.index("--target-model") + 1].endswith("models/target")


def test_server_program_imports_only_stdlib_and_xllamacpp():
    tree = ast.parse(bench.SERVER_SOURCE)
    modules = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
               for alias in n.names}  # fmt: skip
    modules |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert "xllamacpp" in modules
    assert modules - {"xllamacpp"} <= set(sys.stdlib_module_names)


def test_llama_config():
    args = bench.parse_args(["--project-url", "u", "--slots", "2", "--flash-attn"])
    config = bench.llama_config(args, Path("m.gguf"))
    assert config["slots"] == 2 and config["ctx_per_slot"] == 1024 and config["flash_attn"]
    assert config["project_sampling"] and not config["cache_prompt"] and config["draft"] is None


@pytest.mark.skipif(
    not (XLLAMACPP_PYTHON.exists() and TINY_GGUF.exists()),
    reason="needs build/xllamacpp-venv and the tiny SmolLM2 GGUF",
)
def test_real_llamacpp_server_answers_a_chat_request(tmp_path: Path):
    started = time.monotonic()
    args = bench.parse_args(["--project-url", "u", "--threads", "1", "--slots", "2"])
    config = bench.llama_config(args, TINY_GGUF)
    with bench.LlamaServer(XLLAMACPP_PYTHON, config, tmp_path / "llama.log", 60.0) as server:
        assert server.info["kv_unified"] and server.info["n_ctx"] == 2048
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as client:
            response = client.chat.completions.create(
                model="any",
                messages=[{"role": "user", "content": "Write a long story about a cat."}],
                max_tokens=8,
                temperature=0.0,
            )
        usage = response.usage
        assert 1 <= usage.completion_tokens <= 8 and usage.prompt_tokens > 5
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        if response.choices[0].finish_reason == "length":
            assert usage.completion_tokens == 8
    assert server.process.returncode == 0
    assert time.monotonic() - started < 30
