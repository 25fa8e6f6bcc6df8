"""The soak's outputs: the soak.json document, the verdict, summary.txt and memory.png.

The verdict fails a run on any failed request (cancelled ones are not failures), a client loop
still running after the deadline, no stub found, growth >= max_growth after the warm-up, a stub
restart, sequences still live after the load or metrics unreachable then, or a server /dev/shm
region left behind.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from avspec.tools.bench.soak.growth import memory_report
from avspec.tools.bench.soak.load import OUTCOMES, Tally
from avspec.tools.bench.soak.memory import SERVER_NAME, MemorySampler

REPORTED_ERRORS = 20


def build_result(
    config: dict,
    tally: Tally,
    run: dict,
    sampler: MemorySampler | None,
    shm: dict | None,
    warmup_s: float,
    max_growth: float,
) -> dict:
    """The soak.json document; `run` holds elapsed_s, stuck_loops, live_after_load, live_error."""
    result = {
        "config": config,
        "counts": {o: tally.total(o) for o in OUTCOMES},
        "by_protocol": tally.by_protocol(),
        "errors": tally.errors,
        **run,
        "samples": sampler.samples if sampler else [],
        "memory": memory_report(sampler.series(), warmup_s) if sampler else {},
        "restarts": sampler.restarts if sampler else [],
        "shm": shm,
    }
    result["failures"] = verdict(result, max_growth)
    return result


def verdict(result: dict, max_growth: float) -> list[str]:
    """Why the soak failed (empty: it passed)."""
    reasons = []
    if result["counts"]["failed"]:
        reasons.append(f"{result['counts']['failed']} requests failed")
    if result["stuck_loops"]:
        reasons.append(f"{result['stuck_loops']} client loops still running after the deadline")
    if list(result["memory"]) == [SERVER_NAME]:
        reasons.append("no Python-backend stub found (is --model-repository the served one?)")
    for name, m in result["memory"].items():
        if m["growth"] is not None and m["growth"] >= max_growth:
            reasons.append(f"{name} grew {m['growth']:.1%} after warm-up (limit {max_growth:.0%})")
    for r in result["restarts"]:
        pids = f"pid {r['old_pid']} -> {r['new_pid']}"
        reasons.append(f"{r['process']} restarted at {r['t']:.0f} s ({pids})")
    live = {k: v for k, v in result["live_after_load"].items() if v}
    if live:
        reasons.append(f"sequences still live after the load: {live}")
    if result.get("live_error"):
        reasons.append(result["live_error"])
    shm = result.get("shm")
    if shm and shm.get("server_regions_left"):
        reasons.append(f"/dev/shm regions left behind: {shm['server_regions_left']}")
    return reasons


def summary_text(result: dict) -> str:
    """The one-screen summary."""
    c, cfg = result["counts"], result["config"]
    rate = (c["ok"] + c["cancelled"]) / max(result["elapsed_s"], 1e-9)
    protocols = ", ".join(
        f"{p} {v['ok']}/{v['failed']}/{v['cancelled']}" for p, v in result["by_protocol"].items()
    )
    lines = [
        f"soak: {cfg['concurrency']} loops, {result['elapsed_s']:.0f} s (warm-up "
        f"{cfg['warmup_s']:.0f} s), max_tokens {cfg['max_tokens']}",
        f"requests: {c['ok']} ok, {c['failed']} failed, {c['cancelled']} cancelled "
        f"({rate:.1f}/s); {protocols} (ok/failed/cancelled)",
    ]
    for error in result["errors"][:REPORTED_ERRORS]:
        lines.append(f"  error: {error[:200]}")
    lines += _memory_lines(result["memory"])
    lines += _shm_lines(result["samples"], result.get("shm"))
    if result["live_after_load"]:
        lines.append(f"live sequences after the load: {result['live_after_load']}")
    reasons = result["failures"]
    lines.append("PASS" if not reasons else "FAIL: " + "; ".join(reasons))
    return "\n".join(lines) + "\n"


_PLATEAUED: dict[bool | None, str] = {True: "yes", False: "NO"}


def _memory_lines(memory: dict[str, dict]) -> list[str]:
    if not memory:
        return ["memory: not sampled (no --server-pid)"]
    lines = [
        f"{'RSS MiB':<14} {'warm':>8} {'last':>8} {'peak':>8} {'growth':>8} "
        f"{'1st 3rd':>8} {'last 3rd':>8}  plateau"
    ]
    for name, m in memory.items():
        p: dict[str, Any] = m["plateau"] or {}
        plateaued = _PLATEAUED.get(p.get("plateaued"), "-")
        lines.append(
            f"{name:<14} {_num(m['first_after_warmup_mib']):>8} {_num(m['last_mib']):>8} "
            f"{_num(m['peak_mib']):>8} {_pct(m['growth']):>8} "
            f"{_pct(p.get('first_third_growth')):>8} {_pct(p.get('last_third_growth')):>8}  "
            f"{plateaued}"
        )
    return lines


def _shm_lines(samples: list[dict], shm: dict | None) -> list[str]:
    lines = []
    if samples:
        peak = max(s["shm_bytes"] for s in samples)
        ours = [s.get("server_shm_bytes", 0) for s in samples]
        lines.append(
            f"/dev/shm during the run: {_mib(samples[0]['shm_bytes'])} at start, peak "
            f"{_mib(peak)}; the server's regions {_mib(ours[0])} at start, peak {_mib(max(ours))}"
        )
    if shm:
        others = shm["other_new_files"]
        lines.append(
            f"/dev/shm before {_mib(shm['before_bytes'])}, after stop {_mib(shm['after_bytes'])}"
            f" (baseline {'regained' if shm['returned_to_baseline'] else 'NOT regained'}); "
            f"server regions left: {len(shm['server_regions_left'])} of "
            f"{len(shm['server_regions'])}"
            + (f"; other new files: {len(others)}" if others else "")
        )
    return lines


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def plot_memory(path: Path, samples: list[dict], warmup_s: float) -> None:
    """RSS per process and /dev/shm over time, warm-up shaded."""
    import matplotlib  # here: the backend must be chosen before pyplot is imported

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_shm) = plt.subplots(
        2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    names = list(dict.fromkeys(n for s in samples for n in s["rss_mib"]))
    for name in names:
        pts = [(s["t"], s["rss_mib"][name]) for s in samples if name in s["rss_mib"]]
        ax.plot([t for t, _ in pts], [v for _, v in pts], marker=".", label=name)
    ax_shm.plot([s["t"] for s in samples], [s["shm_bytes"] / 2**20 for s in samples], "k-")
    for a in (ax, ax_shm):
        a.axvspan(0, warmup_s, color="grey", alpha=0.2, lw=0)
        a.grid(alpha=0.3)
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("soak: resident memory (warm-up shaded)")
    ax.legend(fontsize=8)
    ax_shm.set_ylabel("/dev/shm (MiB)")
    ax_shm.set_xlabel("seconds since the load started")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out: Path, result: dict) -> str:
    """Write soak.json, memory.png (when there are samples) and summary.txt; the summary."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(result, indent=1) + "\n")
    if result["samples"]:
        plot_memory(out / "memory.png", result["samples"], result["config"]["warmup_s"])
    text = summary_text(result)
    (out / "summary.txt").write_text(text)
    return text
