"""Evaluate acceptance features on labelled drafts (spec section 5) and the oracle bound.

Reads the .npz of client/collect_drafts.py (every draft verified) and prints markdown:

1. the feature table: AUC, log-loss, ECE, mean prediction vs observed rate for logit(q_max)
   fitted online (as served; rows predicted after the first online refit), the same feature
   and each alternative fitted offline (2-fold cross-fit over requests, the served model form
   sigmoid(w f + b_k)), and q_max used directly with no fit;
2. AUC and calibration by draft position (as served);
3. per workload: offline-fitted slope and first intercept, the online estimator's final ones,
   acceptance rate and mean draft entropy;
4. with --cost-tables (a step cost file, avspec.av.cost_file): the oracle bound
   (avspec.tools.bench.oracle.oracle_bound) per workload, with the AV replay started cold (reference
   starting values) and warm (the workload's offline fit, as a server that has run long enough
   would hold), verification only (AV) and with adaptive drafting (AV+drafting).

Writes everything as JSON to --out.

    python client/eval_estimator.py bench/drafts.npz --out bench/estimator_eval.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from avspec.av.calibration import calibration_report
from avspec.av.cost_file import load_step_cost
from avspec.av.estimator import AcceptanceEstimator
from avspec.av.step_cost import StepCost
from avspec.config import EstimatorConfig
from avspec.tools.bench.oracle import RecordedSteps, oracle_bound
from avspec.tools.train.features_zoo import (
    cross_fit_predictions,
    fit_logistic,
    label_matrix,
    rate_by_bins,
)

# (row label, npz feature, how): "served" = recorded online predictions, "fit" = cross-fit,
# "direct" = exp(feature) used as the probability.
FEATURES = (
    ("logit q_max, fitted online (as served)", "served_pred", "served"),
    ("logit q_max, fitted offline", "logit_qmax", "fit"),
    ("log q_max", "log_qmax", "fit"),
    ("top-2 margin", "top2_margin", "fit"),
    ("entropy H(q)", "entropy", "fit"),
    ("-log(-log q_max)", "neg_log_neg_log_qmax", "fit"),
    ("logit q_sampled (lossy)", "logit_qsampled", "fit"),
    ("q_max used directly, no fit", "log_qmax", "direct"),
)


QMAX_EDGES = np.linspace(0.0, 1.0, 11)


def labelled(data: dict[str, np.ndarray], rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(labels, mask) [rows, K] of the selected rows; AV was off, so num_verify = num_draft."""
    k = data["logit_qmax"].shape[1]
    return label_matrix(data["num_draft"][rows], data["num_accepted"][rows], k)


def feature_table(data: dict[str, np.ndarray], rows: np.ndarray) -> list[dict[str, Any]]:
    """One calibration report per FEATURES entry over the labelled drafts of `rows`."""
    labels, mask = labelled(data, rows)
    folds = data["seq_id"][rows] % 2
    served_rows = data["refits"][rows] > 0
    k = labels.shape[1]
    positions = np.broadcast_to(np.arange(k), labels.shape)
    table = []
    for name, key, how in FEATURES:
        values = data[key][rows].astype(np.float64)
        use = mask.copy()
        if how == "served":
            use &= served_rows[:, None]
            pred = values
        elif how == "direct":
            pred = np.exp(values)
        else:
            pred = cross_fit_predictions(values, labels, mask, folds)
        if not use.any():
            continue
        report = calibration_report(np.clip(pred[use], 0, 1), labels[use], positions[use])
        table.append({"feature": name, "lossless": "lossy" not in name, **report})
    return table


def workload_coefficients(data: dict[str, np.ndarray], w: int) -> dict[str, float]:
    """Offline fit of the served model on one workload, its online end state, rate, entropy."""
    rows = np.flatnonzero(data["workload"] == w)
    labels, mask = labelled(data, rows)
    slope, intercepts = fit_logistic(data["logit_qmax"][rows], labels, mask)
    drafted = np.arange(labels.shape[1]) < data["num_draft"][rows][:, None]
    return {
        "labels": int(mask.sum()),
        "slope": slope,
        "intercept_0": float(intercepts[0]),
        "online_slope": float(data["final_slope"][w]),
        "online_intercept_0": float(data["final_intercepts"][w][0]),
        "label_rate": float(labels[mask].mean()),
        "acceptance_rate": float(data["num_accepted"][rows].sum() / data["num_draft"][rows].sum()),
        "mean_entropy": float(data["entropy"][rows][drafted].mean()),
    }


def oracle_for(data: dict[str, np.ndarray], w: int, cost: StepCost) -> dict[str, Any]:
    """Oracle bound of one workload, the AV replay cold (starting values) and warm (offline fit).

    Both replays refit every `refit_interval` steps, as the estimator did while collecting.
    """
    rows = np.flatnonzero(data["workload"] == w)
    recorded = RecordedSteps(
        step=data["step"][rows].astype(np.int64),
        seq_id=data["seq_id"][rows].astype(np.int64),
        num_draft=data["num_draft"][rows].astype(np.int64),
        num_accepted=data["num_accepted"][rows].astype(np.int64),
        features=data["logit_qmax"][rows],
        base_tokens=data["base_tokens"].astype(np.int64),
    )
    k = recorded.features.shape[1]
    config = EstimatorConfig(num_positions=k, refit_interval=int(data.get("refit_interval", 100)))
    cold = oracle_bound(recorded, cost, config=config)
    labels, mask = labelled(data, rows)
    slope, intercepts = fit_logistic(recorded.features, labels, mask)
    warm = AcceptanceEstimator(config)
    warm.slope.fill_(max(slope, config.min_slope))
    warm.intercepts.copy_(torch.as_tensor(intercepts, dtype=torch.float32))
    warm_result = oracle_bound(recorded, cost, estimator=warm)
    cold["av_warm"] = warm_result["av"]
    cold["av_drafting_warm"] = warm_result["av_drafting"]
    for key in ("av_gain", "fraction", "drafting_gain", "drafting_fraction"):
        cold[f"{key}_warm"] = warm_result[key]
    return cold


def fmt(x: float, digits: int = 4) -> str:
    return "n/a" if isinstance(x, float) and math.isnan(x) else f"{x:.{digits}f}"


def print_report(result: dict[str, Any]) -> None:
    for scope, table in result["feature_tables"].items():
        print(f"\n### Feature table: {scope}\n")
        print("| feature | lossless | labels | AUC | log-loss | ECE | mean pred | observed |")
        print("|---|---|---|---|---|---|---|---|")
        for r in table:
            cells = [r["feature"], "yes" if r["lossless"] else "no", str(r["labels"])]
            cells += [
                fmt(r[k]) for k in ("auc", "log_loss", "ece", "mean_predicted", "observed_rate")
            ]
            print("| " + " | ".join(cells) + " |")
    by_qmax = result["acceptance_by_qmax"]
    print("\n### Acceptance by q_max (all workloads and positions)\n")
    print("| q_max | labels | observed |")
    print("|---|---|---|")
    for r in by_qmax["bins"]:
        print(f"| {r['low']:.1f}-{r['high']:.1f} | {r['labels']} | {fmt(r['observed_rate'])} |")
    verdict = "monotone" if by_qmax["monotone"] else "NOT monotone"
    print(f"\nAcceptance is {verdict} in q_max over the bins with >= 50 labels.")
    served = result["feature_tables"]["all"][0]
    print("\n### By draft position (logit q_max as served, all workloads)\n")
    print("| position | labels | AUC | ECE | mean pred | observed |")
    print("|---|---|---|---|---|---|")
    for r in served["per_position"]:
        cells = [str(r["position"]), str(r["labels"])]
        cells += [fmt(r[k]) for k in ("auc", "ece", "mean_predicted", "observed_rate")]
        print("| " + " | ".join(cells) + " |")
    print("\n### Coefficients per workload (logit q_max)\n")
    print(
        "| workload | labels | slope (offline) | b_0 (offline) | slope (online) | b_0 (online) "
        "| P(accept) per label | accepted / drafted | mean entropy (nats) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, c in result["coefficients"].items():
        keys = (
            "slope",
            "intercept_0",
            "online_slope",
            "online_intercept_0",
            "label_rate",
            "acceptance_rate",
            "mean_entropy",
        )
        print(f"| {name} | {c['labels']} | " + " | ".join(fmt(c[k], 3) for k in keys) + " |")
    if result.get("oracle"):
        print("\n### Oracle bound (modelled with the cost tables)\n")
        # (label, arm, gain key, fraction key) without the "_warm" suffix of the warm start
        arms = (("AV", "av", "av_gain", "fraction"),
                ("AV+drafting", "av_drafting", "drafting_gain", "drafting_fraction"))  # fmt: skip
        columns = ["workload", "fixed K tok/ms", "oracle tok/ms", "oracle gain"]
        for label, *_ in arms:
            for start in ("cold", "warm"):
                name = f"{label} {start}"
                columns += [f"{name} tok/ms", f"{name} gain", f"{name} / oracle gain"]
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        for name, o in result["oracle"].items():
            cells = [fmt(o["fixed"]["tokens_per_ms"]), fmt(o["oracle"]["tokens_per_ms"])]
            cells.append(f"{100 * o['oracle_gain']:+.1f}%")
            for _, arm, gain, fraction in arms:
                for suffix in ("", "_warm"):
                    cells.append(fmt(o[arm + suffix]["tokens_per_ms"]))
                    cells.append(f"{100 * o[gain + suffix]:+.1f}%")
                    cells.append(fmt(o[fraction + suffix], 3))
            print(f"| {name} | " + " | ".join(cells) + " |")
        print("\nStatic trim (verify the first k of the drafts of every request), tokens/ms:\n")
        k = len(next(iter(result["oracle"].values()))["trim_to_k"]) - 1
        print("| workload | " + " | ".join(f"k={i}" for i in range(k + 1)) + " |")
        print("|---|" + "---|" * (k + 1))
        for name, o in result["oracle"].items():
            print(f"| {name} | " + " | ".join(fmt(x) for x in o["trim_to_k"]) + " |")


def evaluate(data: dict[str, np.ndarray], cost: StepCost | None) -> dict[str, Any]:
    """Feature tables, coefficients and, with a step cost, the oracle bound per workload."""
    names = [str(n) for n in data["workloads"]]
    result: dict[str, Any] = {"feature_tables": {}, "coefficients": {}, "oracle": {}}
    everything = np.arange(data["step"].size)
    result["feature_tables"]["all"] = feature_table(data, everything)
    labels, mask = labelled(data, everything)
    q_max = np.exp(data["log_qmax"].astype(np.float64))
    bins, monotone = rate_by_bins(q_max, labels, mask, QMAX_EDGES)
    result["acceptance_by_qmax"] = {"bins": bins, "monotone": monotone}
    for w, name in enumerate(names):
        rows = np.flatnonzero(data["workload"] == w)
        result["feature_tables"][name] = feature_table(data, rows)
        result["coefficients"][name] = workload_coefficients(data, w)
        if cost is not None:
            result["oracle"][name] = oracle_for(data, w, cost)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("drafts", type=Path, help=".npz written by client/collect_drafts.py")
    parser.add_argument(
        "--cost-tables", type=Path, default=None, help="step cost file (oracle; profiler JSON)"
    )
    parser.add_argument("--out", type=Path, default=None, help="JSON file to write")
    args = parser.parse_args(argv)
    cost = None
    if args.cost_tables is not None:
        if not args.cost_tables.is_file():
            parser.error(f"--cost-tables {args.cost_tables} does not exist")
        try:
            cost = load_step_cost(args.cost_tables)
        except ValueError as err:  # malformed, or the old format: the message says what to run
            parser.error(f"--cost-tables: {err}")
    with np.load(args.drafts) as npz:
        data = {name: npz[name] for name in npz.files}
    result = evaluate(data, cost)
    print_report(result)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=float) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
