#!/usr/bin/env bash
# Served tokens/s of the default pair by stage threads: 1 (default), 2 with passive OpenMP waits, 2 spinning.
cd "$(dirname "$0")/../.."
out=bench/stage_threads; mkdir -p $out
run() {  # name threads wait_policy
  name=$1; threads=$2; policy=$3
  env ${policy:+OMP_WAIT_POLICY=$policy} .venv/bin/python -m avspec.serving.host.launcher --model-repository model_repository \
    --draft-model models/draft --target-model models/target --http-port 8100 --grpc-port 8101 --metrics-port 8102 \
    --cpu-threads $threads > /tmp/serve_$name.log 2>&1 &
  pid=$!
  for i in $(seq 1 120); do grep -q "avspec: serving" /tmp/serve_$name.log && break; sleep 1; done
  .venv/bin/python client/bench_openai.py --url http://127.0.0.1:8100 --endpoint completions --workloads chat \
    --concurrency 1,16 --requests 24 --warmup-requests 8 --max-tokens 64 --temperature 0.7 --top-p 0.95 \
    --out $out/$name.json > $out/$name.txt 2>&1
  kill -INT $pid; wait $pid
}
run t1 1 ""
run t2_passive 2 PASSIVE
run t2_spin 2 ""
run t1_again 1 ""
