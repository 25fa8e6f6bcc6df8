"""Serving-benchmark statistics and the throughput/interactivity frontier.

Triton-free so that it is unit-tested on constructed inputs; `client/bench_serving.py` feeds it
timings from the server. The oracle bound on recorded drafts is `avspec.tools.bench.oracle`.

Definitions (docs/benchmarks.md):
- output tokens/s: tokens received by all requests of an arm / the arm's wall time;
- tokens/s per user (interactivity): per request, tokens after the first response divided by
  the time from the first response to the last; averaged over requests;
- TTFT: first response carrying tokens - request sent;
- ITL: each later response's gap since the previous token-carrying response, split evenly over
  its tokens (one value per token), so a response with 3 tokens after 30 ms gives 3 x 10 ms;
- a point is on the frontier if no other point of its workload has both at least its tokens/s
  and at least its tokens/s per user, one of them strictly more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

X_KEY, Y_KEY = "tokens_per_s_per_user", "output_tokens_per_s"


@dataclass
class RequestRecord:
    """Client-side timings of one streamed request (seconds on one monotonic clock)."""

    sent: float
    chunk_times: list[float] = field(default_factory=list)  # each response with outputs
    chunk_tokens: list[int] = field(default_factory=list)  # tokens it carried (may be 0)
    drafted: int = 0
    verified: int = 0
    accepted: int = 0
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(self.chunk_tokens)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100, linear interpolation); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else math.nan


def _token_chunks(record: RequestRecord) -> list[tuple[float, int]]:
    return [(t, n) for t, n in zip(record.chunk_times, record.chunk_tokens, strict=True) if n > 0]


def inter_token_latencies(record: RequestRecord) -> list[float]:
    """Per-token latencies in seconds after the first token-carrying response (see module doc)."""
    chunks = _token_chunks(record)
    out: list[float] = []
    for (t0, _), (t1, n) in zip(chunks, chunks[1:], strict=False):
        out += [(t1 - t0) / n] * n
    return out


def time_to_first_token(record: RequestRecord) -> float:
    """Seconds from sending to the first response carrying tokens; NaN if none did."""
    chunks = _token_chunks(record)
    return chunks[0][0] - record.sent if chunks else math.nan


def user_rate(record: RequestRecord) -> float:
    """Tokens/s of one request after its first token; NaN with fewer than two token responses."""
    chunks = _token_chunks(record)
    if len(chunks) < 2 or chunks[-1][0] <= chunks[0][0]:
        return math.nan
    return sum(n for _, n in chunks[1:]) / (chunks[-1][0] - chunks[0][0])


def summarize_arm(records: Sequence[RequestRecord], wall_s: float) -> dict[str, float]:
    """Per-arm statistics over its requests (failed requests count only in `errors`)."""
    if wall_s <= 0:
        raise ValueError(f"wall_s must be > 0, got {wall_s}")
    ok = [r for r in records if r.error is None]
    tokens = sum(r.tokens for r in ok)
    steps = sum(len(r.chunk_times) for r in ok)
    drafted, verified, accepted = (
        sum(getattr(r, k) for r in ok) for k in ("drafted", "verified", "accepted")
    )
    ttft = [t for t in map(time_to_first_token, ok) if not math.isnan(t)]
    itl = [x for r in ok for x in inter_token_latencies(r)]
    rates = [x for x in map(user_rate, ok) if not math.isnan(x)]
    return {
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        Y_KEY: tokens / wall_s,
        X_KEY: float(np.mean(rates)) if rates else math.nan,
        "ttft_ms_median": 1e3 * percentile(ttft, 50),
        "ttft_ms_p99": 1e3 * percentile(ttft, 99),
        "itl_ms_median": 1e3 * percentile(itl, 50),
        "itl_ms_p99": 1e3 * percentile(itl, 99),
        "steps": steps,
        "drafted": drafted,
        "verified": verified,
        "accepted": accepted,
        "accepted_per_pass": accepted / steps if steps else math.nan,
        "tokens_per_pass": tokens / steps if steps else math.nan,
        "acceptance_rate": accepted / verified if verified else math.nan,
    }


def pareto_mask(xs: Sequence[float], ys: Sequence[float]) -> list[bool]:
    """True where no other point has x' >= x and y' >= y with one strict (both maximised).

    A point with a NaN coordinate is never on the frontier and dominates nothing.
    """
    pts = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True)]
    mask = []
    for i, (x, y) in enumerate(pts):
        if math.isnan(x) or math.isnan(y):
            mask.append(False)
            continue
        dominated = any(
            j != i and x2 >= x and y2 >= y and (x2 > x or y2 > y)
            for j, (x2, y2) in enumerate(pts)
            if not (math.isnan(x2) or math.isnan(y2))
        )
        mask.append(not dominated)
    return mask


def mark_frontier(points: list[dict[str, Any]]) -> None:
    """Set point["on_frontier"] per workload over all its (concurrency, arm) points."""
    for workload in {p["workload"] for p in points}:
        group = [p for p in points if p["workload"] == workload]
        for p, on in zip(
            group, pareto_mask([p[X_KEY] for p in group], [p[Y_KEY] for p in group]), strict=True
        ):
            p["on_frontier"] = on


def frontier_by_concurrency(points: list[dict[str, Any]], workload: str) -> dict[int, list[str]]:
    """{concurrency: arms on the frontier at it}, for points already passed to mark_frontier."""
    out: dict[int, list[str]] = {}
    for p in points:
        if p["workload"] == workload:
            arms = out.setdefault(int(p["concurrency"]), [])
            if p.get("on_frontier"):
                arms.append(p["arm"])
    return dict(sorted(out.items()))


HIGH_CONCURRENCY = 16  # from here on AV must beat the best fixed K by HIGH_GOAL
HIGH_GOAL, LOW_GOAL = 1.10, 0.98


def goal_checks(
    points: list[dict[str, Any]], workload: str, av_arm: str, fixed_arms: Sequence[str]
) -> dict[str, Any]:
    """The adaptive-drafting goals for one workload, from points passed to mark_frontier.

    At each concurrency: the AV arm's output tokens/s over the best fixed-K arm's (the envelope
    a static schedule such as TensorRT-LLM's draft_len_schedule can reach). Goals: >= HIGH_GOAL
    at every concurrency >= HIGH_CONCURRENCY, >= LOW_GOAL below it, and on the frontier at every
    concurrency. Missing arms give NaN ratios (and fail the goal).
    """
    table = {(p["concurrency"], p["arm"]): p for p in points if p["workload"] == workload}
    levels = sorted({c for c, _ in table})

    def tps(c: int, arm: str) -> float:
        return float(table[(c, arm)][Y_KEY]) if (c, arm) in table else math.nan

    ratio = {}
    for c in levels:
        best = max((tps(c, a) for a in fixed_arms), default=math.nan)
        ratio[c] = tps(c, av_arm) / best if best == best and best > 0 else math.nan
    high = [ratio[c] for c in levels if c >= HIGH_CONCURRENCY]
    low = [ratio[c] for c in levels if c < HIGH_CONCURRENCY]
    av_on = [c for c in levels if table.get((c, av_arm), {}).get("on_frontier")]
    return {
        "av_over_best_fixed": {str(c): r for c, r in ratio.items()},
        "high_goal_met": bool(high) and all(r >= HIGH_GOAL for r in high),
        "low_goal_met": bool(low) and all(r >= LOW_GOAL for r in low),
        "av_on_frontier": av_on,
        "av_on_frontier_count": len(av_on),
        "concurrencies": len(levels),
    }


def plot_frontier(
    path: Path, workload: str, points: list[dict[str, Any]], av: str, note: str = ""
) -> None:
    """Throughput against interactivity, one line per arm over concurrency (`av` in red, its
    concurrencies labelled), the frontier dashed; `note` ends the title (e.g. "modelled")."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    group = [p for p in points if p["workload"] == workload]
    fig, ax = plt.subplots(figsize=(7, 5))
    for arm in dict.fromkeys(p["arm"] for p in group):
        pts = sorted((p for p in group if p["arm"] == arm), key=lambda p: p["concurrency"])
        style = {"color": "red", "linewidth": 2.5, "zorder": 3} if arm == av else {"alpha": 0.6}
        ax.plot([p[X_KEY] for p in pts], [p[Y_KEY] for p in pts], marker="o", label=arm, **style)
        if arm == av:
            for p in pts:
                ax.annotate(f"c={p['concurrency']}", (p[X_KEY], p[Y_KEY]), fontsize=7)
    front = sorted((p for p in group if p.get("on_frontier")), key=lambda p: p[X_KEY])
    ax.plot([p[X_KEY] for p in front], [p[Y_KEY] for p in front], "k--", lw=1, label="frontier")
    ax.set_xlabel("tokens/s per user (interactivity)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{workload}: throughput vs interactivity ({av} in red){note}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


SAME_LENGTH_GOAL, BEST_ARM_GOAL = 1.20, 0.98


def set_and_forget_goals(
    points: list[dict[str, Any]], workload: str, kmax: int = 8
) -> dict[str, Any]:
    """The served goals of set-and-forget AV for one workload: at each concurrency, av<kmax>
    over k<kmax> (the same draft length; goal >= SAME_LENGTH_GOAL from HIGH_CONCURRENCY on)
    and ad<kmax> over the best other arm, no speculation included (goal >= BEST_ARM_GOAL at
    every concurrency). Missing arms give NaN ratios (and fail the goal)."""
    table = {
        (p["concurrency"], p["arm"]): float(p[Y_KEY]) for p in points if p["workload"] == workload
    }
    levels = sorted({c for c, _ in table})
    av, ad, fixed = f"av{kmax}", f"ad{kmax}", f"k{kmax}"
    same, best = {}, {}
    for c in levels:
        same[c] = table.get((c, av), math.nan) / table.get((c, fixed), math.nan)
        others = [v for (cc, arm), v in table.items() if cc == c and arm != ad]
        best[c] = table.get((c, ad), math.nan) / max(others) if others else math.nan
    high = [same[c] for c in levels if c >= HIGH_CONCURRENCY]
    return {
        "av_over_k": {str(c): r for c, r in same.items()},
        "ad_over_best_arm": {str(c): r for c, r in best.items()},
        "same_length_goal_met": bool(high) and all(r >= SAME_LENGTH_GOAL for r in high),
        "best_arm_goal_met": bool(best) and all(r >= BEST_ARM_GOAL for r in best.values()),
    }
