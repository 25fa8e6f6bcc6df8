"""client/gpu_check.py on the CPU: the CUDA verifier path, skips and failures."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from helpers.client_scripts import load_client_script
from torch.utils._python_dispatch import TorchDispatchMode

from avspec.av import verifier as verifier_module
from avspec.av.drafting import DraftPlan
from avspec.av.step_cost import StepCost

gpu_check = load_client_script("gpu_check")
CPU = torch.device("cpu")
aten = torch.ops.aten

pytestmark = pytest.mark.usefixtures("single_thread")


class HostSyncStandIn(TorchDispatchMode):
    """A CPU stand-in for torch.cuda.set_sync_debug_mode("warn"), for `set_mode`.

    On the CPU every tensor is a host tensor, so `.item()` cannot be told from host bookkeeping;
    what it can catch are the ops whose output shape depends on the data (nonzero, masked_select,
    unique, boolean-mask reads and writes of more than one value), which on CUDA must read the
    device to size their output.
    It warns with CUDA's message from inside the op, as torch does on the GPU.
    """

    SYNCING = (aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
               aten.unique_consecutive.default, aten.unique_dim.default)  # fmt: skip

    def __init__(self) -> None:
        super().__init__()
        self.modes: list[int | str] = []

    def __call__(self, mode: int | str) -> None:
        self.modes.append(mode)
        if mode == "warn":
            self.__enter__()
        else:
            self.__exit__(None, None, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCING or (func in self.MASKABLE and self._by_mask(func, args)):
            warnings.warn(
                f"called a synchronizing CUDA operation\n(CPU stand-in: {func})", stacklevel=2
            )
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

        def recording_step(inputs):
            decision = step(inputs)
            decisions.append((decision, inputs.num_drafted))
            return decision

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
    pass under the stand-in; each step drafts by the previous plan (the first by the caps),
    trims to a valid count and returns the next plan."""
    one_step, verifier, decisions = verifier_steps_keeping_the_verifier(
        monkeypatch, batch=6, k=4, device=CPU, steps=12, refit_interval=5
    )
    assert isinstance(verifier.cost, StepCost) and verifier.drafting
    set_mode = HostSyncStandIn()
    result = gpu_check.run_under_sync_debug(one_step, 12, set_mode)
    assert result == {"status": "passed", "steps": 12}
    assert set_mode.modes == ["warn", 0]
    assert (verifier.estimator.num_steps, verifier.estimator.num_refits) == (12, 2)
    assert len(decisions) == 12
    assert decisions[0][1].tolist() == [4] * 6  # no plan yet: every row drafts its cap
    for decision, drafted in decisions:
        assert decision.num_verify.shape == (6,) and decision.num_verify.dtype == torch.int32
        assert drafted.shape == (6,) and int(drafted.min()) >= 1 and int(drafted.max()) <= 4
        assert int(decision.num_verify.min()) >= 0
        assert bool((decision.num_verify <= drafted).all())
        assert DraftPlan.from_tensor(decision.draft_plan, 4) is not None
    assert any(int(d.trimmed) > 0 for d, _ in decisions), "AV never trimmed a draft"
    assert any(int(d.stopped_early) > 0 for d, _ in decisions), "the plan never stopped a row"


def test_a_verifier_step_with_a_data_dependent_shape_fails_the_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Broken variant: the verifier step masks its stale scores by value before planning (a host
    sync on CUDA). The check fails, names the avspec frame it went through, counts the site once
    a step, and restores the mode."""
    real = verifier_module.plan_step

    def plan_step_after_a_mask(stale, *args, **kwargs):
        _ = stale[stale > 0.5]  # boolean-mask indexing: nonzero on the device
        return real(stale, *args, **kwargs)

    monkeypatch.setattr(verifier_module, "plan_step", plan_step_after_a_mask)
    one_step, _, decisions = verifier_steps_keeping_the_verifier(
        monkeypatch, batch=6, k=4, device=CPU, steps=4
    )
    set_mode = HostSyncStandIn()
    result = gpu_check.run_under_sync_debug(one_step, 4, set_mode)
    assert result["status"] == "failed"
    assert result["error"] == "called a synchronizing CUDA operation"
    frames = result["frames"]
    assert any(frame.startswith("verifier.py:") and " step: " in frame for frame in frames)
    # both calls of the broken plan_step (this step's budget, the next step's plan), every step
    sites = result["sites"]
    assert sites[0]["frames"] == frames and [site["count"] for site in sites] == [4, 4]
    assert len(decisions) == 4
    assert set_mode.modes == ["warn", 0]
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
    assert modes == ["warn", 0]
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
    assert 1.0 <= pipeline["draft_passes_per_step"] <= 3.0
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


def test_planned_drafts_follow_the_draft_stage_rule() -> None:
    """Draft 0 always; position i while i < depth and the survival up to i - 1 stays >= tau;
    at most the cap. No plan: the caps."""
    caps = torch.tensor([4, 4, 2, 4], dtype=torch.int32)
    features = torch.zeros(4, 4)
    assert torch.equal(gpu_check.planned_drafts(torch.zeros(0), features, caps), caps)
    # slope 1, intercepts ln 0.9/0.1 etc.: confidences 0.9, 0.8, 0.5, 0.5 at features 0
    c = torch.tensor([0.9, 0.8, 0.5, 0.5])
    plan = DraftPlan(0.5, 3, 1.0, tuple(torch.logit(c).tolist())).to_tensor()
    features[1] = torch.tensor([0.0, -9.0, 0.0, 0.0])  # survival 0.9, ~0.0001: stops after 2
    features[3, 0] = -9.0  # survival ~0.0001 at position 0: drafts only x_0
    got = gpu_check.planned_drafts(plan, features, caps)
    # row 0: s = 0.9, 0.72, 0.36: drafts 0, 1, 2 (depth 3); row 2: cap 2
    assert got.tolist() == [3, 2, 2, 1] and got.dtype == torch.int32
    strict = DraftPlan(0.8, 4, 1.0, tuple(torch.logit(c).tolist())).to_tensor()
    assert gpu_check.planned_drafts(strict, torch.zeros(4, 4), caps).tolist() == [2, 2, 2, 2]


def test_planned_drafts_agree_with_the_library_rule() -> None:
    """The device-only rule equals avspec.av.drafting.drafted_by_plan (host plan) for plans of
    depth >= 1 (plan_step never plans depth 0)."""
    from avspec.av.drafting import drafted_by_plan

    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(1, 6, (), generator=gen))
        batch = int(torch.randint(1, 8, (), generator=gen))
        plan = DraftPlan(
            float(torch.rand((), generator=gen)) * 0.8,
            int(torch.randint(1, k + 1, (), generator=gen)),
            float(torch.rand((), generator=gen)) + 0.1,
            tuple(torch.randn(k, generator=gen).tolist()),
        )
        features = torch.randn(batch, k, generator=gen) * 3
        caps = torch.randint(0, k + 1, (batch,), generator=gen).int()
        got = gpu_check.planned_drafts(plan.to_tensor(), features, caps)
        assert torch.equal(got, drafted_by_plan(features, caps, plan, list(range(batch)))), plan
