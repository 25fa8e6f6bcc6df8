"""A fleet prior: several replicas' estimator snapshots combined by their sufficient statistics.

Every replica runs its own estimator (`avspec.av.estimator`), warm-started from one shared prior
and then refitted on its own traffic. `combine` turns the replicas' snapshots
(`avspec.av.snapshot`) back into one prior, in the snapshot format, so that the next rollout
starts every pod from what the whole fleet learned.

What a snapshot holds, per replica r: coefficients theta_r = (w_r, b_r) and the OPEN window's
accumulators A_k, B_k, C_k, G0_k, G1_k, n_k (`avspec.av.refit`), all collected at theta_r (the
coefficients do not change inside a window). Windows already closed were cleared at their refit:
their evidence is in theta_r, and nowhere is it counted. So:

- the information of replica r is the open window's Fisher information, the arrowhead
  H_r = [[sum_k A_k, B^T], [B, diag(C)]] over (w, b_0..b_{K-1}); its gradient g_r = (sum_k G0_k,
  G1) is the evidence the replica has not yet applied;
- the prior's coefficients are the information-weighted mean (the Laplace / product-of-Gaussians
  combination)

      theta* = (sum_r H_r + a I)^-1 (sum_r H_r theta_r + a theta_bar)

  with a small anchor a (the ridge) towards theta_bar, the plain mean of the replicas that have
  refitted at least once (all replicas if none has), so that positions or replicas with no open
  evidence stay defined: with every window empty, theta* = theta_bar;
- the prior's accumulators are the open windows pooled AT theta*: A, B, C and n add (they are
  sums over labels, whose weights s = p (1 - p) are taken as unchanged by the move), the residual
  sums are re-centred to theta* to first order,
      G0_k += G0_{r,k} - (A_{r,k} dw_r + B_{r,k} db_{r,k}),
      G1_k += G1_{r,k} - (B_{r,k} dw_r + C_{r,k} db_{r,k}),   (dw_r, db_r) = theta* - theta_r,
  so a pod's first refit applies the fleet's pending evidence once, damped as every refit is;
- the counters start again: num_steps = num_refits = 0. Neither lifetime counter weighs
  anything: a replica that has run a million steps has cleared all but its open window, and its
  coefficients carry no more evidence than the estimator kept (adding the cleared counts would
  let a long-lived pod outvote the fleet with data nobody holds any more).

All snapshots must have the same K (num_positions) and record the same draft/target pair (or
none): a prior for one pair is no prior for another.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from avspec.av.estimator import AcceptanceEstimator
from avspec.av.snapshot import SnapshotError, load_snapshot, save_snapshot, snapshot_pair
from avspec.config import EstimatorConfig


@dataclass
class Replica:
    """One replica's snapshot: coefficients, its open window's accumulators and counters."""

    slope: float
    intercepts: torch.Tensor  # [K] float64
    stats: dict[str, torch.Tensor]  # A, B, C, G0, G1, n: each [K] float64
    num_steps: int = 0
    num_refits: int = 0
    pair: str | None = None

    @property
    def num_positions(self) -> int:
        return int(self.intercepts.shape[0])


def read_replica(path: Path) -> Replica:
    """Read one snapshot file (checked by `load_snapshot`, with the K it records)."""
    path = Path(path)
    try:
        k = int(json.loads(path.read_text(encoding="utf-8"))["config"]["num_positions"])
        config = EstimatorConfig(num_positions=k)
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise SnapshotError(f"cannot read estimator snapshot {path}: {err!r}") from None
    state = load_snapshot(path, config).state_dict()
    return Replica(
        slope=float(state["slope"]),
        intercepts=state["intercepts"].double(),
        stats={name: t.double() for name, t in state["stats"].items()},
        num_steps=state["num_steps"],
        num_refits=state["num_refits"],
        pair=snapshot_pair(path),
    )


def information(replica: Replica) -> tuple[torch.Tensor, torch.Tensor]:
    """(H [K+1, K+1], g [K+1]) of the replica's open window, parameters ordered (w, b_0..)."""
    s = replica.stats
    k = replica.num_positions
    h = torch.zeros(k + 1, k + 1, dtype=torch.float64)
    h[0, 0] = s["A"].sum()
    h[0, 1:] = s["B"]
    h[1:, 0] = s["B"]
    h[1:, 1:] = torch.diag(s["C"])
    g = torch.cat((s["G0"].sum().reshape(1), s["G1"]))
    return h, g


def coefficients(replica: Replica) -> torch.Tensor:
    """theta_r = (w, b_0..b_{K-1}) as one float64 vector."""
    return torch.cat((torch.tensor([replica.slope], dtype=torch.float64), replica.intercepts))


def combine(replicas: Sequence[Replica], anchor: float = 1e-3) -> Replica:
    """The fleet prior of `replicas` (see the module docstring); counters 0, pair kept."""
    if not replicas:
        raise ValueError("no snapshots to combine")
    k = replicas[0].num_positions
    if any(r.num_positions != k for r in replicas):
        raise ValueError(f"snapshots differ in K: {sorted({r.num_positions for r in replicas})}")
    pairs = {r.pair for r in replicas if r.pair is not None}
    if len(pairs) > 1:
        raise ValueError(f"snapshots record different draft/target pairs: {sorted(pairs)}")
    if not anchor > 0:
        raise ValueError(f"anchor must be > 0, got {anchor}")
    learned = [r for r in replicas if r.num_refits > 0] or list(replicas)
    theta_bar = torch.stack([coefficients(r) for r in learned]).mean(dim=0)
    total_h = anchor * torch.eye(k + 1, dtype=torch.float64)
    weighted = anchor * theta_bar
    for r in replicas:
        h, _ = information(r)
        total_h += h
        weighted += h @ coefficients(r)
    theta = torch.linalg.solve(total_h, weighted)
    stats = {name: torch.zeros(k, dtype=torch.float64) for name in ("A", "B", "C", "G0", "G1", "n")}
    for r in replicas:
        s = r.stats
        delta = theta - coefficients(r)
        dw, db = delta[0], delta[1:]
        for name in ("A", "B", "C", "n"):
            stats[name] += s[name]
        stats["G0"] += s["G0"] - (s["A"] * dw + s["B"] * db)
        stats["G1"] += s["G1"] - (s["B"] * dw + s["C"] * db)
    return Replica(
        slope=float(theta[0]),
        intercepts=theta[1:].clone(),
        stats=stats,
        num_steps=0,
        num_refits=0,
        pair=next(iter(pairs)) if pairs else None,
    )


def write_prior(prior: Replica, path: Path, config: EstimatorConfig | None = None) -> None:
    """Save `prior` in the snapshot format (`save_snapshot`: bounds checked, atomic)."""
    config = config or EstimatorConfig(num_positions=prior.num_positions)
    estimator = AcceptanceEstimator(config)
    state = estimator.state_dict()
    state.update(
        slope=torch.tensor(max(prior.slope, config.min_slope), dtype=torch.float32),
        intercepts=prior.intercepts.float(),
        stats={name: t.clone() for name, t in prior.stats.items()},
        num_steps=prior.num_steps,
        num_refits=prior.num_refits,
    )
    estimator.load_state_dict(state)
    save_snapshot(estimator, Path(path), prior.pair or "")


def combine_files(paths: Sequence[Path], out: Path, anchor: float = 1e-3) -> Replica:
    """Read the snapshots at `paths`, combine them and write the prior to `out`."""
    prior = combine([read_replica(Path(p)) for p in paths], anchor)
    write_prior(prior, out)
    return prior
