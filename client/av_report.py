"""Report a set-and-forget sweep: the served goals and what the budget chose per concurrency.

Reads sweep directories written by `client/bench_serving.py --start-server --step-log` (the
step log extracted by avspec.tools.bench.replay_inputs, as client/replay_steps.py does) and
writes to --out:

- `goals.txt`: per directory, output tokens/s of every arm at every concurrency, av8 / k8 (the
  same draft length; goal >= 1.20 at 16-64) and ad8 / the best other arm, no speculation
  included (goal >= 0.98 at every concurrency);
- `budget_<directory>.png`: for av8 and ad8, per concurrency, the drafts per decode row the
  caps allowed, drafted, verified and accepted, and the share the budget trimmed: why AV did
  what it did (the same quantities as the server's av_* counters);
- `budget.json`: those numbers;
- `goals_full_batch.txt`: the same table over the steps where every user was busy
  (avspec.tools.bench.full_batch: the steady state, without the phase's tail of finishing
  requests), with the share of each phase they cover. A diagnostic: the goals are the phase's.

    python client/av_report.py bench/av_sweep/torch-t1.0-chat bench/av_sweep/torch-t1.0-code \
        --out bench/av_sweep
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from avspec.tools.bench.budget_view import budget_choices
from avspec.tools.bench.frontier import Y_KEY, set_and_forget_goals
from avspec.tools.bench.full_batch import full_batch_rate
from avspec.tools.bench.replay_inputs import extract, load
from avspec.tools.script import doc_parser

ARMS = ("none", "k1", "k2", "k4", "k8", "av8", "ad8")


def goals_text(name: str, points: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    workload = points[0]["workload"]
    goals = set_and_forget_goals(points, workload)
    table = {(p["concurrency"], p["arm"]): p[Y_KEY] for p in points}
    levels = sorted({c for c, _ in table})
    lines = [f"== {name} ==", f"{'conc':>4} " + " ".join(f"{a:>6}" for a in ARMS)
             + "  av8/k8  ad8/best"]  # fmt: skip
    for c in levels:
        values = " ".join(f"{table.get((c, a), float('nan')):>6.1f}" for a in ARMS)
        lines.append(
            f"{c:>4} {values}  {goals['av_over_k'][str(c)]:>6.2f}  "
            f"{goals['ad_over_best_arm'][str(c)]:>8.2f}"
        )
    lines.append(
        f"av8 >= 1.20 x k8 at 16-64: {'met' if goals['same_length_goal_met'] else 'missed'}; "
        f"ad8 >= 0.98 x the best arm everywhere: "
        f"{'met' if goals['best_arm_goal_met'] else 'missed'}"
    )
    return "\n".join(lines) + "\n", goals


def full_batch_points(
    phases: dict[int, dict[str, list[list[dict[str, Any]]]]], workload: str
) -> list[dict[str, Any]]:
    """Per (concurrency, arm): tokens/s over the phase's full-batch steps, as sweep points."""
    points = []
    for c, by_arm in sorted(phases.items()):
        for arm, runs in by_arm.items():
            rate = full_batch_rate([line for run in runs for line in run], c)
            points.append({"workload": workload, "concurrency": c, "arm": arm,
                           Y_KEY: rate["tokens_per_s"], "share": rate["share"]})  # fmt: skip
    return points


def share_text(points: list[dict[str, Any]]) -> str:
    """The share of each phase's time its full-batch steps cover, per concurrency and arm."""
    table = {(p["concurrency"], p["arm"]): p["share"] for p in points}
    lines = ["share of the phase at full batch:"]
    for c in sorted({c for c, _ in table}):
        lines.append(
            f"{c:>4} " + " ".join(f"{table.get((c, a), float('nan')):>6.0%}" for a in ARMS)
        )
    return "\n".join(lines) + "\n"


def plot_budget(path: Path, name: str, choices: dict[str, dict[int, dict[str, float]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {"av8": "--", "ad8": "-"}
    for arm, by_c in choices.items():
        levels = sorted(by_c)
        for key, colour in (("drafted_per_row", "tab:blue"), ("verified_per_row", "tab:orange"),
                            ("accepted_per_row", "tab:green")):  # fmt: skip
            left.plot(levels, [by_c[c][key] for c in levels], styles[arm], marker="o",
                      color=colour, label=f"{arm} {key.replace('_per_row', '')}")  # fmt: skip
        right.plot(levels, [by_c[c]["trimmed_share"] for c in levels], styles[arm], marker="o",
                   color="tab:red", label=f"{arm} trimmed by the budget")  # fmt: skip
        if arm == "ad8":
            right.plot(levels, [by_c[c]["stopped_early_share"] for c in levels], "-", marker="s",
                       color="tab:purple", label="ad8 not drafted (plan stopped)")  # fmt: skip
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    left.set_ylabel("drafts per decode row per step (cap 8)")
    right.set_ylabel("share")
    right.set_ylim(0, 1)
    fig.suptitle(f"{name}: what the budget chose")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = doc_parser(__doc__)
    p.add_argument("directories", type=Path, nargs="+", help="bench_serving --step-log outputs")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    texts, steady_texts, document = [], [], {}
    for directory in args.directories:
        extract(directory, "k8")
        phases, _, sweep = load(directory)
        name = directory.name
        text, goals = goals_text(name, sweep["points"])
        choices = {
            arm: {
                c: budget_choices([line for run in by_arm[arm] for line in run])
                for c, by_arm in sorted(phases.items())
                if arm in by_arm
            }
            for arm in ("av8", "ad8")
        }
        plot_budget(args.out / f"budget_{name}.png", name, choices)
        steady = full_batch_points(phases, sweep["points"][0]["workload"])
        steady_text, steady_goals = goals_text(f"{name}, full-batch steps", steady)
        steady_texts.append(steady_text + share_text(steady))
        document[name] = {
            "goals": goals,
            "budget": choices,
            "full_batch": steady,
            "full_batch_goals": steady_goals,
        }
        texts.append(text)
    (args.out / "goals.txt").write_text("\n".join(texts))
    (args.out / "goals_full_batch.txt").write_text("\n".join(steady_texts))
    (args.out / "budget.json").write_text(json.dumps(document, indent=1) + "\n")
    print("\n".join(texts), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
