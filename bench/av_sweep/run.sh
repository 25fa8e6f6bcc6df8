#!/usr/bin/env bash
# Issue 35's served sweep: every arm x concurrency 1..64, one runtime and temperature per call.
#   bench/av_sweep/run.sh ENGINE TEMPERATURE [CONCURRENCY] [WORKLOADS] [SUFFIX]
# Writes bench/av_sweep/<engine>-t<temperature>-<workload><suffix>/ (points, frontier plots,
# summary, the host's lscpu); a suffix such as -epyc keeps another host's sweep beside this one
# with the step log under server/ for client/replay_steps.py. Chat answers of 256 tokens,
# code 128 (--ignore-eos: every answer runs to its length, so every arm does the same work);
# one request per user per phase (at least 2), held-out prompts that fit the context.
set -euo pipefail
cd "$(dirname "$0")/../.."
engine=${1:?engine}; temperature=${2:?temperature}
concurrency=${3:-1,2,4,8,16,32,64}; workloads=${4:-chat,code}; suffix=${5:-}
for workload in ${workloads//,/ }; do
  tokens=256; [ "$workload" = code ] && tokens=128
  out="bench/av_sweep/$engine-t$temperature-$workload$suffix"
  mkdir -p "$out" && lscpu > "$out/host_lscpu.txt"
  # prompt + answer + 8 drafts must fit the served max_context (512)
  .venv/bin/python client/bench_serving.py --start-server --engine "$engine" --step-log \
    --workloads "$workload" --max-tokens "$tokens" \
    --max-prompt-tokens $((512 - tokens - 8)) --temperature "$temperature" --top-p 0.95 \
    --concurrency "$concurrency" --arms none,k1,k2,k4,k8,av8,ad8 --prompts 64 --rounds 1 \
    --requests-per-user 1 --min-requests 2 --warmup-requests 8 --ignore-eos \
    --out "$out"
done
