#!/usr/bin/env bash
# Before/after the attention tiles: the same short chat sweep, twice each, alternating.
# BEFORE: a checkout of the parent commit (git worktree add /tmp/before 896d8bf; link its
# models/target to this checkout's).
set -u
cd "$(dirname "$0")/../.."
root=$(pwd)
before=${BEFORE:-/tmp/before}
for round in 1 2; do
  for side in before after; do
    if [[ $side == before ]]; then pp=$before/backend; else pp=$root/backend; fi
    PYTHONPATH=$pp timeout 1500 .venv/bin/python client/bench_serving.py --start-server \
      --model-repository "$root/model_repository" --cost-tables "$root/models/cost_tables.json" \
      --concurrency 16,64 --arms none,k2,ad8 --workloads chat --prompts 64 --max-tokens 32 \
      --temperature 0.7 --rounds 1 --out "build/ragged-$side-$round" > "build/ragged-$side-$round.log" 2>&1
    echo "$side $round done $(date)"
  done
done
