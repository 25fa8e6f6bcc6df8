"""Replay the served steps of a sweep under a cost model: this host's (to check the replay
against the served figures) or a modelled GPU's.

Reads sweep directories written by `client/bench_serving.py --start-server --step-log`. The
first run over a directory extracts what a replay needs into files that can be committed:
`recorded_steps.jsonl.gz` (the step-log lines of every phase, tagged with concurrency and arm;
features kept for the `--source` arm only), `cost_tables.json` (the tables the server was
given) and `estimator.json` (the verifier's starting estimator). Then every arm is replayed at
every concurrency from those steps through the verifier's and the drafting plan's own
functions (avspec.tools.bench.replay):

- host (default): the profiled tables refreshed by the stage times recorded at the same
  concurrency (every arm's steps: the cost of each step shape as served); a step in which no row
  drafts runs the draft's pass or not as the recording's server did (it has deferred them since
  December 7, avspec.tools.bench.replay). The decisions, drafts and outcomes of every arm come
  from the source arm's steps alone. Writes
  `replay_host.json` / `.txt`: predicted against served tokens/s at every point;
- `--gpu`: a modelled GPU target (avspec.tools.bench.gpu_cost; Llama-3.1-8B verifying and
  Llama-3.2-1B drafting on an H100 by default); writes to `--out` the modelled points, the
  goals (ad8 against the best fixed K, against no speculation, share of the oracle's gain) and
  frontier plots, every figure labelled modelled.

    python client/replay_steps.py bench/av_sweep/torch-t1.0-chat bench/av_sweep/torch-t1.0-code
    python client/replay_steps.py bench/av_sweep/torch-t1.0-* --gpu --out bench/av_sweep/gpu

`--probe-interval 0` replays the verifier without the probe of stopped drafting plans, as it
was served before December 6 (the sweeps recorded that day), to validate against them.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from avspec.av.cost_file import load_step_cost
from avspec.av.verifier import PROBE_INTERVAL
from avspec.tools.bench.frontier import (
    X_KEY,
    Y_KEY,
    goal_checks,
    mark_frontier,
    plot_frontier,
)
from avspec.tools.bench.gpu_cost import gpu_step_cost
from avspec.tools.bench.replay import (
    draft_deferred,
    recorded_steps,
    replay_point,
    served_cost,
    served_lengths,
)
from avspec.tools.bench.replay_inputs import COSTS, extract, load
from avspec.tools.script import doc_parser

ARMS = ("none", "k1", "k2", "k4", "k8", "av8", "ad8")


def replay_directory(directory: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One point per (concurrency, arm) replayed from `directory`'s recording."""
    extract(directory, args.source)
    phases, config, document = load(directory)
    workload = document["config"]["workloads"][0]
    gpu = gpu_step_cost(context=args.context, overhead_ms=args.overhead_ms)
    profiled = load_step_cost(directory / COSTS)
    arms = [*ARMS, "oracle"]
    points = []
    for c, by_arm in sorted(phases.items()):
        # this host: the tables refreshed by every arm's steps at this concurrency
        served = [p for r in by_arm.values() for p in r]
        cost = gpu if args.gpu else served_cost(profiled, served)
        lines = [line for run in by_arm[args.source] for line in run]
        recorded = recorded_steps(lines, config.num_positions)
        lengths = None
        if not args.gpu:  # each arm's requests as long as they were served
            lengths = {
                arm: [n for run in runs for n in served_lengths(run)]
                for arm, runs in by_arm.items()
            }
        result = replay_point(
            recorded, cost, arms, c, config, defers_draft=args.gpu or draft_deferred(served),
            lengths=lengths,
            probe_interval=args.probe_interval,
        )  # fmt: skip
        for arm, values in result.items():
            points.append({"workload": workload, "concurrency": c, "arm": arm, **values})
    return points


def validation(directory: Path, replayed: list[dict[str, Any]]) -> tuple[str, dict]:
    """Predicted against served tokens/s per point; (table text, the document written)."""
    served = json.loads((directory / "points.json").read_text())["points"]
    by_point = {(p["concurrency"], p["arm"]): p for p in replayed}
    rows, worst = [], 0.0
    for p in sorted(served, key=lambda p: (p["concurrency"], ARMS.index(p["arm"]))):
        r = by_point.get((p["concurrency"], p["arm"]))
        if r is None:
            continue
        error = r[Y_KEY] / p[Y_KEY] - 1
        worst = max(worst, abs(error))
        rows.append(
            {
                "concurrency": p["concurrency"], "arm": p["arm"], "served": p[Y_KEY],
                "predicted": r[Y_KEY], "error": error, "served_per_user": p[X_KEY],
                "predicted_per_user": r[X_KEY],
            }
        )  # fmt: skip
    lines = [
        f"{directory.name}: replay with this host's tables refreshed by the recorded steps",
        f"{'conc':>4} {'arm':>5} {'served':>8} {'replay':>8} {'error':>7} "
        f"{'per user':>8} {'replay':>8}",
    ]
    lines += [
        f"{r['concurrency']:>4} {r['arm']:>5} {r['served']:>8.1f} {r['predicted']:>8.1f} "
        f"{r['error']:>+7.1%} {r['served_per_user']:>8.2f} {r['predicted_per_user']:>8.2f}"
        for r in rows
    ]
    lines.append(f"largest |error|: {worst:.1%} over {len(rows)} points (goal: within 10%)")
    return "\n".join(lines) + "\n", {"rows": rows, "worst_error": worst}


def gpu_summary(points: list[dict[str, Any]], workload: str) -> tuple[str, dict]:
    """The replay goals on modelled GPU costs for one workload; (text, document)."""
    real = [p for p in points if p["workload"] == workload and p["arm"] != "oracle"]
    mark_frontier(real)
    goals = goal_checks(real, workload, "ad8", ["k1", "k2", "k4", "k8"])
    table = {(p["concurrency"], p["arm"]): p[Y_KEY] for p in points if p["workload"] == workload}
    levels = sorted({c for c, _ in table})
    fraction = {}
    for c in levels:
        best = max(table[(c, k)] for k in ("k1", "k2", "k4", "k8"))
        gain = table[(c, "oracle")] - best
        fraction[str(c)] = (table[(c, "ad8")] - best) / gain if gain > 0 else math.nan
    goals["ad_over_none_c1"] = table[(levels[0], "ad8")] / table[(levels[0], "none")]
    goals["oracle_fraction_over_best_fixed"] = fraction
    lines = [f"== {workload} (modelled) ==", f"{'conc':>4} " + " ".join(
        f"{a:>7}" for a in (*ARMS, "oracle")) + "   ad8/best K  of oracle gain"]  # fmt: skip
    for c in levels:
        values = " ".join(f"{table[(c, a)]:>7.0f}" for a in (*ARMS, "oracle"))
        lines.append(
            f"{c:>4} {values}   {goals['av_over_best_fixed'][str(c)]:>10.3f}  "
            f"{fraction[str(c)]:>13.0%}"
        )
    lines.append(
        f"ad8 / best fixed K >= 1.10 at 16-64: {'met' if goals['high_goal_met'] else 'missed'}; "
        f">= 0.98 at 1-8: {'met' if goals['low_goal_met'] else 'missed'}; ad8 / none at "
        f"c={levels[0]}: {goals['ad_over_none_c1']:.2f} (goal >= 2.0); on the frontier at "
        f"{goals['av_on_frontier_count']} of {goals['concurrencies']}"
    )
    return "\n".join(lines) + "\n", goals


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("directories", type=Path, nargs="+", help="bench_serving --step-log outputs")
    p.add_argument(
        "--source", default="k8", help="the arm whose steps are replayed (all drafts verified)"
    )
    p.add_argument("--gpu", action="store_true", help="price the steps on a modelled GPU")
    p.add_argument("--context", type=int, default=512, help="--gpu: KV tokens each row reads")
    p.add_argument("--overhead-ms", type=float, default=2.0, help="--gpu: fixed ms per step")
    p.add_argument("--out", type=Path, default=None, help="--gpu: output directory")
    p.add_argument(
        "--probe-interval", type=int, default=PROBE_INTERVAL,
        help="the verifier's probe of stopped plans (0: as served before probes, December 6)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.gpu and args.out is None:
        p.error("--gpu needs --out")
    texts, documents, all_points = [], {}, []
    for directory in args.directories:
        points = replay_directory(directory, args)
        label = directory.name
        for point in points:
            point["workload"] = label
        if args.gpu:
            text, documents[label] = gpu_summary(points, label)
            all_points += points
        else:
            text, document = validation(directory, points)
            (directory / "replay_host.json").write_text(json.dumps(document, indent=1) + "\n")
            (directory / "replay_host.txt").write_text(text)
        texts.append(text)
    if args.gpu:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {"context": args.context, "overhead_ms": args.overhead_ms, "source": args.source}
        document = {
            "modelled": True,
            "settings": settings,
            "goals": documents,
            "points": all_points,
        }
        (args.out / "points.json").write_text(json.dumps(document, indent=1) + "\n")
        (args.out / "summary.txt").write_text("\n".join(texts))
        for label in documents:
            real = [q for q in all_points if q["workload"] == label and q["arm"] != "oracle"]
            plot_frontier(args.out / f"frontier_{label}.png", label, real, "ad8", " - MODELLED")
    print("\n".join(texts), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
