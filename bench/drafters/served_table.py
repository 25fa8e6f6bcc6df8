"""The two served sweeps side by side (bench/drafters/{draft,head}/points.json, written by
client/bench_serving.py): accepted per verified draft token and tokens/s, head over draft.

    .venv/bin/python bench/drafters/served_table.py > bench/drafters/served.txt
    .venv/bin/python bench/drafters/served_table.py llamacpp_ > bench/drafters/served_llamacpp.txt

An argument names the sweeps' directory prefix (`llamacpp_`: the target on llama.cpp's engine).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).parent


def points(kind: str) -> dict[tuple[str, int, str], dict]:
    loaded = json.loads((HERE / kind / "points.json").read_text())["points"]
    return {(p["workload"], p["concurrency"], p["arm"]): p for p in loaded}


def main() -> None:
    prefix = sys.argv[1] if len(sys.argv) > 1 else ""
    draft, head = points(f"{prefix}draft"), points(f"{prefix}head")
    print(f"{'workload':<9} {'conc':>4} {'arm':>4}  {'acc/verified draft':>18} {'head':>6}  "
          f"{'tok/s draft':>11} {'head':>6} {'head/draft':>10}")  # fmt: skip
    for key in sorted(draft):
        d, h = draft[key], head.get(key)
        if h is None:
            continue
        ratio = h["output_tokens_per_s"] / d["output_tokens_per_s"]
        print(f"{key[0]:<9} {key[1]:>4} {key[2]:>4}  {d['acceptance_rate']:>18.3f} "
              f"{h['acceptance_rate']:>6.3f}  {d['output_tokens_per_s']:>11.1f} "
              f"{h['output_tokens_per_s']:>6.1f} {ratio:>10.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
