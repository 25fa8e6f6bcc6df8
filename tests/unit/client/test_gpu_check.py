"""client/gpu_check.py on the CPU: the CUDA verifier path, skips and failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.client_scripts import load_client_script

gpu_check = load_client_script("gpu_check")
CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def single_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_verifier_step_path_runs_on_the_cpu_with_refits() -> None:
    """The closure the sync check runs on CUDA: same code, CPU tensors, refit every 5 steps."""
    one_step = gpu_check.verifier_steps(batch=6, k=4, device=CPU, steps=12, refit_interval=5)
    for _ in range(12):
        one_step()


def test_sync_check_is_skipped_without_cuda() -> None:
    result = gpu_check.check_sync(4, 4, CPU, steps=3)
    assert result["status"] == "skipped" and "no CUDA" in result["reason"]


def test_sync_debug_failure_names_the_avspec_frame_and_restores_the_mode() -> None:
    modes = []

    def syncing_step() -> None:
        from avspec.checks import check_finite

        check_finite("x", torch.tensor([1.0]))  # an avspec frame in the traceback
        raise RuntimeError("called a synchronizing CUDA operation\nmore")

    result = gpu_check.run_under_sync_debug(syncing_step, 3, modes.append)
    assert result["status"] == "failed"
    assert result["error"] == "called a synchronizing CUDA operation"
    assert modes == ["error", 0]
    passed = gpu_check.run_under_sync_debug(lambda: None, 2, modes.append)
    assert passed == {"status": "passed", "steps": 2} and modes[-1] == 0


def test_cuda_request_without_cuda_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="no CUDA"):
        gpu_check.pick_device("cuda")
    assert gpu_check.pick_device("auto") == CPU


def test_cli_on_cpu_reports_every_check(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "report.json"
    code = gpu_check.main(["--device", "cpu", "--batch", "3", "--draft-tokens", "3", "--steps",
                           "2", "--repeats", "3", "--width", "32", "--json", str(out)])  # fmt: skip
    assert code == 0
    report = json.loads(out.read_text())
    assert report["sync"]["status"] == "skipped"
    assert report["verifier"]["status"] == "passed" and report["verifier"]["batch"] == 3
    pipeline = report["pipeline"]
    assert pipeline["status"] == "passed"
    assert 1.0 <= pipeline["tokens_per_step_per_sequence"] <= 4.0
    assert "sync check SKIPPED" in capsys.readouterr().out


def test_auto_without_cuda_skips_the_pipeline_and_a_failure_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def broken(*args, **kwargs):
        raise ValueError("boom")

    monkeypatch.setattr(gpu_check, "bench_verifier", broken)
    assert gpu_check.main(["--batch", "2", "--repeats", "2"]) == 1
    printed = capsys.readouterr().out
    assert "pipeline check SKIPPED" in printed and "FAILED: verifier" in printed
