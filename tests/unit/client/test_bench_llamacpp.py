"""client/bench_llamacpp.py without llama.cpp or a server: arguments, the missing venv, the
worker protocol (against a stand-in `llama_cpp` module), figures, summary and ratios."""

from __future__ import annotations

import ast
import math
import os
import sys
from pathlib import Path

import pytest
from helpers.client_scripts import load_client_script

serving = load_client_script("bench_serving")  # imported by name by bench_llamacpp
bench = load_client_script("bench_llamacpp")

FAKE_LLAMA_CPP = """
import types

__version__ = "0.0-fake"
_internals = types.SimpleNamespace(LlamaSampler=object)


class _Perf:
    t_p_eval_ms = 12.5
    t_eval_ms = 40.0
    n_p_eval = 7
    n_eval = 3


class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, verbose):
        assert n_threads == n_threads_batch == 1 and not verbose
        print("noise on stdout from the library")
        self.ctx = object()
        self._n_ctx = n_ctx

    def n_ctx(self):
        return self._n_ctx

    def reset(self):
        pass

    def create_completion(self, prompt, max_tokens, seed, **kw):
        if prompt == "boom":
            raise ValueError("bad prompt")
        assert set(kw) == {"temperature", "top_p"}
        return {
            "choices": [{"text": prompt[::-1], "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens},
        }


def llama_perf_context_reset(ctx):
    pass


def llama_perf_context(ctx):
    return _Perf()
"""


def test_parse_args_defaults_and_errors(tmp_path: Path):
    args = bench.parse_args([])
    assert [a.name for a in args.arm_list] == ["none", "k4", "ad8"]
    assert (args.prompts, args.max_tokens, args.rounds, args.threads) == (16, 64, 2, 1)
    assert (args.temperature, args.top_p) == (0.7, 0.95)
    assert args.llama_python == bench.ROOT / "build/llamacpp-venv/bin/python"
    assert args.out == bench.ROOT / "bench/llamacpp" and not args.start_server
    args = bench.parse_args(["--arms", "none,ad8", "--prompts", "2", "--out", str(tmp_path)])
    assert [a.name for a in args.arm_list] == ["none", "ad8"] and args.prompts == 2
    for bad in (["--arms", "k9"], ["--prompts", "0"], ["--rounds", "0"], ["--arms", "k2,k2"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_missing_venv_is_a_clear_error(tmp_path: Path, capsys):
    missing = tmp_path / "nope" / "bin" / "python"
    with pytest.raises(bench.LlamaWorkerError, match="llamacpp-venv") as err:
        bench.check_llama_python(missing)
    assert "pip install llama-cpp-python==0.3.36" in str(err.value) and str(missing) in str(
        err.value
    )
    assert bench.check_llama_python(Path(sys.executable)) == Path(sys.executable)
    assert bench.main(["--llama-python", str(missing), "--out", str(tmp_path / "o")]) == 2
    assert "python3.11 -m venv build/llamacpp-venv" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_worker_source_imports_only_stdlib_and_llama_cpp():
    tree = ast.parse(bench.WORKER_SOURCE)
    names = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert names - sys.stdlib_module_names == {"llama_cpp"}


def test_worker_protocol_with_a_stand_in_llama_cpp(tmp_path: Path):
    (tmp_path / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    log = tmp_path / "worker.log"
    with bench.LlamaWorker(Path(sys.executable), tmp_path / "m.gguf", log, env=env) as worker:
        assert worker.info["ready"] and worker.info["llama_cpp_version"] == "0.0-fake"
        assert worker.info["n_ctx"] == 512
        answer = worker.complete("abc", 5, 0.7, 0.95, 3)
        assert answer["completion_tokens"] == 5 and answer["prompt_tokens"] == 3
        assert answer["text"] == "cba" and answer["prompt_eval_ms"] == 12.5
        assert answer["wall_s"] >= 0
        with pytest.raises(bench.LlamaWorkerError, match="bad prompt"):
            worker.complete("boom", 5, 0.7, 0.95, 3)
        args = bench.parse_args(["--max-tokens", "5", "--seed", "10"])
        phase = bench.llama_phase(worker, ["ab", "abcd"], args, 0)
    assert phase["tokens"] == 10 and phase["prompt_tokens"] == [2, 4]
    assert phase["at_max_tokens"] == 2 and phase["finish_reasons"] == ["length", "length"]
    assert "noise on stdout" in log.read_text()


def test_worker_that_cannot_import_llama_cpp(tmp_path: Path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    with pytest.raises(bench.LlamaWorkerError, match="llama-cpp-python"):
        bench.LlamaWorker(Path(sys.executable), tmp_path / "m.gguf", tmp_path / "w.log", env=env)


def test_phase_figures():
    f = bench.phase_figures("x", 0, [4, 1, 8], [1.0, 0.5, 2.5], [0.25, 0.5, 0.5], 8)
    assert f["tokens"] == 13 and f["e2e_s"] == 4.0 and f["tokens_per_s"] == 13 / 4
    assert f["decode_tokens_per_s"] == pytest.approx((3 / 0.75 + 7 / 2.0) / 2)  # 1 token: NaN
    assert f["first_token_ms_median"] == 500.0 and f["at_max_tokens"] == 1


def test_end_to_end():
    record = bench.RequestRecord(sent=1.0, chunk_times=[1.5, 2.0, 2.2], chunk_tokens=[1, 3, 0])
    assert bench.end_to_end(record) == 1.0
    assert math.isnan(bench.end_to_end(bench.RequestRecord(sent=1.0)))


def test_round_plan_alternates_sides():
    arms = serving.parse_arms("none,k4,ad8", 8)
    plan = [(r, s if isinstance(s, str) else s.name) for r, s in bench.round_plan(arms, 3)]
    assert plan == [
        (0, "llama.cpp"), (0, "none"), (0, "k4"), (0, "ad8"),
        (1, "k4"), (1, "ad8"), (1, "none"), (1, "llama.cpp"),
        (2, "llama.cpp"), (2, "ad8"), (2, "none"), (2, "k4"),
    ]  # fmt: skip


def phase(side, r, rate, tokens=64, requests=2):
    return {
        "side": side, "round": r, "requests": requests, "tokens": tokens,
        "tokens_per_s": rate, "decode_tokens_per_s": 2 * rate, "first_token_ms_median": 10.0,
        "at_max_tokens": 1,
    }  # fmt: skip


def test_summarize_ratios_and_table():
    phases = [
        phase("llama.cpp", 0, 100.0), phase("none", 0, 50.0), phase("ad8", 0, 150.0),
        phase("ad8", 1, 130.0), phase("none", 1, 70.0), phase("llama.cpp", 1, 80.0),
    ]  # fmt: skip
    s = bench.summarize(phases, ["none", "ad8"])
    assert s["llama.cpp"]["tokens_per_s_median"] == 90.0
    assert s["ad8"]["tokens_per_s_by_round"] == [150.0, 130.0]
    assert s["ad8"]["ratio_to_llamacpp"] == pytest.approx(140 / 90)
    assert s["ad8"]["ratio_by_round"] == pytest.approx([1.5, 130 / 80])
    assert s["none"]["ratio_to_llamacpp"] == pytest.approx(60 / 90)
    assert s["ad8"]["faster_than_llamacpp"] and not s["none"]["faster_than_llamacpp"]
    assert s["none"]["tokens_per_request"] == 32 and "ratio_to_llamacpp" not in s["llama.cpp"]
    args = bench.parse_args(["--arms", "none,ad8", "--prompts", "2"])
    info = {"llama_cpp_version": "0.3.36", "load_start": [1.0, 1, 1], "load_end": [2.0, 1, 1]}
    text = bench.summary_text(args, s, args.arm_list, info)
    assert "ad8 faster (1.56x)" in text and "none" not in text.splitlines()[-1]
    row = next(line for line in text.splitlines() if line.strip().startswith("ad8"))
    assert row.split()[:5] == ["ad8", "150.0", "130.0", "140.0", "1.56"]


def test_load_prompts_takes_the_first(tmp_path: Path):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(f'{{"prompt": "p{i}", "messages": []}}\n' for i in range(5)))
    assert bench.load_prompts(path, 3) == ["p0", "p1", "p2"]
    with pytest.raises(ValueError, match="fewer"):
        bench.load_prompts(path, 6)
