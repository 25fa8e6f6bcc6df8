"""client/gpu_check.py on the CPU: the CUDA verifier path, skips and failures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers.client_scripts import load_client_script
from torch.utils._python_dispatch import TorchDispatchMode

from avspec.av import verifier as verifier_module

gpu_check = load_client_script("gpu_check")
CPU = torch.device("cpu")
aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("single_thread")


class HostSyncStandIn(TorchDispatchMode):
    """A CPU stand-in for torch.cuda.set_sync_debug_mode("error"), for `set_mode`.

    On the CPU every tensor is a host tensor, so `.item()` cannot be told from host bookkeeping;
    what it can catch are the ops whose output shape depends on the data (nonzero, masked_select,
    unique, boolean-mask reads and writes of more than one value), which on CUDA must read the
    device to size their output.
    It raises CUDA's message, so run_under_sync_debug reports it as it would on the GPU.
    """

    SYNCING = (aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
               aten.unique_consecutive.default, aten.unique_dim.default)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[int | str] = []

    def __call__(self, mode: int | str) -> None:
        self.modes.append(mode)
        if mode == "error":
            self.__enter__()
        else:
            self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING or (func in self.MASKABLE and self._by_mask(func, args)):
            raise RuntimeError(f"called a synchronizing CUDA operation\n(CPU stand-in: {func})")
        return func(*args, **(kwargs or {}))

    MASKABLE = (aten.index.Tensor, aten.index_put_.default, aten.index_put.default)

    @staticmethod
    def _by_mask(func, args) -> bool:
        if not any(i is not None and i.dtype == torch.bool for i in args[1]):
            return False
        # x[mask] = one value runs as masked_fill_ on CUDA (no sync); any other value syncs
        return func is aten.index.Tensor or args[2].numel() != 1


def verifier_steps_keeping_the_verifier(monkeypatch: pytest.MonkeyPatch, **kwargs):
    """gpu_check.verifier_steps, plus the AdaptiveVerifier it built and the decisions it made."""
    built, decisions = [], []

    def make_verifier(*args):
        verifier = original(*args)
        step = verifier.step

        def recording_step(*step_args, **step_kwargs):
            decisions.append(step(*step_args, **step_kwargs))
            return decisions[-1]

        verifier.step = recording_step
        built.append(verifier)
        return verifier

    original = gpu_check.make_verifier
    monkeypatch.setattr(gpu_check, "make_verifier", make_verifier)
    one_step = gpu_check.verifier_steps(**kwargs)
    return one_step, built[0], decisions


def test_verifier_step_path_passes_the_sync_stand_in_and_refits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The closure the sync check runs on CUDA, on CPU tensors: 12 steps with a refit every 5
    pass under the stand-in, and each step trims 4 drafts of 6 sequences to a valid count."""
    one_step, verifier, decisions = verifier_steps_keeping_the_verifier(
        monkeypatch, batch=6, k=4, device=CPU, steps=12, refit_interval=5
    )
    set_mode = HostSyncStandIn()
    result = gpu_check.run_under_sync_debug(one_step, 12, set_mode)
    assert result == {"status": "passed", "steps": 12}
    assert set_mode.modes == ["error", 0]
    assert (verifier.estimator.num_steps, verifier.estimator.num_refits) == (12, 2)
    assert len(decisions) == 12
    for decision in decisions:
        assert decision.num_verify.shape == (6,) and decision.num_verify.dtype == torch.int32
        assert int(decision.num_verify.min()) >= 0 and int(decision.num_verify.max()) <= 4
    assert any(int(d.num_verify.sum()) < 24 for d in decisions), "AV never trimmed a draft"


def test_a_verifier_step_with_a_data_dependent_shape_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broken variant: the verifier step masks its scores by value before budgeting (a host sync
    on CUDA). The check fails, names the avspec frame it went through, and restores the mode."""
    real = verifier_module.choose_budget

    def choose_budget_after_a_mask(scores, *args):
        _ = scores[scores > 0.5]  # boolean-mask indexing: nonzero on the device
        return real(scores, *args)

    monkeypatch.setattr(verifier_module, "choose_budget", choose_budget_after_a_mask)
    one_step, _, decisions = verifier_steps_keeping_the_verifier(
        monkeypatch, batch=6, k=4, device=CPU, steps=4
    )
    set_mode = HostSyncStandIn()
    result = gpu_check.run_under_sync_debug(one_step, 4, set_mode)
    assert result["status"] == "failed"
    assert result["error"] == "called a synchronizing CUDA operation"
    frames = result["frames"]
    assert any(frame.startswith("verifier.py:") and " step: " in frame for frame in frames)
    assert set_mode.modes == ["error", 0] and decisions == []
    assert torch.ones(3)[torch.tensor([True, False, True])].tolist() == [1.0, 1.0]  # mode left


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
