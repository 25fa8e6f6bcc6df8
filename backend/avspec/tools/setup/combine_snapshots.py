"""Combine several replicas' estimator snapshots into one fleet prior (`avspec.av.prior`).

    python -m avspec.tools.setup.combine_snapshots --out prior.json pod-0.json pod-1.json pod-2.json

The prior is a snapshot file: mount it read-only into every pod (deploy/chart, values
`estimator.prior`), where it warm-starts each replica's own estimator. Weights come from each
snapshot's open-window sufficient statistics, never from the lifetime counters (docs/scale_out.md).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from avspec.av.prior import combine_files
from avspec.av.snapshot import SnapshotError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshots", nargs="+", type=Path, help="replicas' snapshot files")
    parser.add_argument("--out", required=True, type=Path, help="the prior to write")
    parser.add_argument(
        "--anchor", type=float, default=1e-3, help="pull towards the replicas' plain mean"
    )
    args = parser.parse_args(argv)
    try:
        prior = combine_files(args.snapshots, args.out, args.anchor)
    except (SnapshotError, ValueError) as err:
        print(f"combine_snapshots: {err}", file=sys.stderr)
        return 1
    labels = int(prior.stats["n"].sum())
    intercepts = ", ".join(f"{b:.4f}" for b in prior.intercepts.tolist())
    print(
        f"prior of {len(args.snapshots)} snapshots -> {args.out}: slope {prior.slope:.4f}, "
        f"intercepts [{intercepts}], open-window labels {labels}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
