#!/usr/bin/env bash
# before/after the attention tiles: the same short chat sweep, twice each, alternating
set -u
cd /work/main
for round in 1 2; do
  for side in before after; do
    if [[ $side == before ]]; then pp=/tmp/before/backend; else pp=/work/main/backend; fi
    PYTHONPATH=$pp timeout 1500 .venv/bin/python client/bench_serving.py --start-server \
      --model-repository /work/main/model_repository --cost-tables /work/main/models/cost_tables.json \
      --concurrency 16,64 --arms none,k2,ad8 --workloads chat --prompts 64 --max-tokens 32 \
      --temperature 0.7 --rounds 1 --out build/ragged-$side-$round > build/ragged-$side-$round.log 2>&1
    echo "$side $round done $(date)"
  done
done
