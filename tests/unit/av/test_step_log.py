"""The step log: one JSON line per step, a torn line skipped, a failing disk never fails a step."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from avspec.av.step_log import StepLog, read_step_log
from avspec.contract import VerifierInputs


def inputs(batch: int = 2, drafted: int = 2) -> VerifierInputs:
    return VerifierInputs(
        seq_ids=torch.arange(batch),
        features=torch.full((batch, 3), 0.123456),
        num_draft_tokens=torch.full((batch,), 3),
        adaptive=torch.ones(batch, dtype=torch.bool),
        prev_num_accepted=torch.zeros(0, dtype=torch.int32),
        release_seq_ids=torch.zeros(0, dtype=torch.int64),
        base_tokens=batch,
        num_drafted=torch.full((batch,), drafted),
    )


def test_lines_hold_the_drafted_features_and_read_back_by_window(tmp_path: Path) -> None:
    log = StepLog(tmp_path / "a" / "steps.jsonl")
    log.append(inputs(), torch.tensor([2, 1]), 3)
    log.append(inputs(batch=0), torch.zeros(0), 0)  # an empty batch is not a step
    log.append(inputs(drafted=1), torch.tensor([1, 1]), 2)
    log.close()
    lines = read_step_log(tmp_path / "a" / "steps.jsonl")
    assert log.num_lines == 2 and len(lines) == 2
    assert lines[0]["features"] == [[0.1235, 0.1235], [0.1235, 0.1235]]
    assert lines[0]["verify"] == [2, 1] and lines[0]["budget"] == 3 and lines[0]["caps"] == [3, 3]
    assert lines[1]["features"] == [[0.1235], [0.1235]]
    assert read_step_log(tmp_path / "a" / "steps.jsonl", start=lines[1]["t"]) == lines[1:]
    assert read_step_log(tmp_path / "a" / "steps.jsonl", end=lines[0]["t"]) == []


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    log.append(inputs(), torch.tensor([2, 2]), 4)
    log.close()
    with path.open("a") as f:
        f.write(json.dumps({"t": 1.0})[:5])
    assert len(read_step_log(path)) == 1


def test_a_write_failure_turns_the_log_off_without_raising(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "steps.jsonl").mkdir()  # a directory where the file should be
    log = StepLog(tmp_path / "steps.jsonl")
    with caplog.at_level(logging.WARNING):
        log.append(inputs(), torch.tensor([2, 2]), 4)
        log.append(inputs(), torch.tensor([2, 2]), 4)
    assert log.off and log.num_lines == 0
    assert caplog.text.count("the step log is off") == 1
