"""The files a replay of a served sweep reads, extracted once from the sweep's directory.

A sweep directory is what `client/bench_serving.py --start-server --step-log` wrote: points.json
(with each point's wall-clock windows) and, under server/ (not kept in git), the step log and
the served repository copy. `extract` writes beside points.json, in files meant to be committed:

- `recorded_steps.jsonl.gz`: the step-log lines of every phase, tagged with concurrency and
  arm; the features are kept for the `source` arm only (the arm a replay replays);
- `cost_tables.json`: the cost tables the server's verifier was given;
- `estimator.json`: the verifier's starting estimator (EstimatorConfig fields).
"""

from __future__ import annotations

import gzip
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

from avspec.av.step_log import read_step_log
from avspec.config import EstimatorConfig
from avspec.serving import pbtxt
from avspec.serving.repository import parse_verifier_parameters

RECORDED, COSTS, ESTIMATOR = "recorded_steps.jsonl.gz", "cost_tables.json", "estimator.json"


def extract(directory: Path, source: str) -> None:
    """Write the replay's inputs into `directory` from its served copy (once)."""
    if (directory / RECORDED).is_file():
        return
    server = directory / "server"
    log = server / "step_log.jsonl"
    if not log.is_file():
        raise FileNotFoundError(f"{directory}: neither {RECORDED} nor {log} (run with --step-log)")
    points = json.loads((directory / "points.json").read_text())["points"]
    with gzip.open(directory / RECORDED, "wt", encoding="utf-8") as out:
        for p in points:
            for start, end in p["windows"]:
                for line in read_step_log(log, start, end):
                    if p["arm"] != source:
                        del line["features"]  # the other arms' steps only price the cost model
                    tags = {"concurrency": p["concurrency"], "arm": p["arm"]}
                    out.write(json.dumps({**tags, **line}, separators=(",", ":")) + "\n")
    config = pbtxt.parse((server / "model_repository/verifier/config.pbtxt").read_text())
    estimator, params = parse_verifier_parameters(pbtxt.parameters(config))
    shutil.copyfile(params.cost_tables, directory / COSTS)
    (directory / ESTIMATOR).write_text(json.dumps(asdict(estimator), indent=1) + "\n")


Line = dict[str, Any]  # one step-log line
Phases = dict[int, dict[str, list[list[Line]]]]  # {concurrency: {arm: [phase lines]}}


def load(directory: Path) -> tuple[Phases, EstimatorConfig, dict[str, Any]]:
    """({concurrency: {arm: phases of step-log lines}}, the estimator config, the sweep's
    document)."""
    phases: Phases = {}
    last: tuple[int, str, float] | None = None
    with gzip.open(directory / RECORDED, "rt", encoding="utf-8") as f:
        for text in f:
            line = json.loads(text)
            c, arm = line.pop("concurrency"), line.pop("arm")
            runs = phases.setdefault(c, {}).setdefault(arm, [])
            if last is None or last[:2] != (c, arm) or line["t"] < last[2]:
                runs.append([])
            runs[-1].append(line)
            last = (c, arm, line["t"])
    config = EstimatorConfig(**json.loads((directory / ESTIMATOR).read_text()))
    return phases, config, json.loads((directory / "points.json").read_text())
