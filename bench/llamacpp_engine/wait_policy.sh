#!/usr/bin/env bash
# Served c=1 / c=16 tokens/s of the llama.cpp engine: ggml's OpenMP workers spinning (default) or
# passive after each graph, and 1 thread per stage (issue 32: an idle stage must not take the
# cores from the busy one). Chat, 64 tokens, 16 requests a level; arms one after the other.
cd "$(dirname "$0")/../.."
out=bench/llamacpp_engine; mkdir -p $out
run() {  # name engine_threads wait_policy
  name=$1; threads=$2; policy=$3
  env ${policy:+OMP_WAIT_POLICY=$policy} .venv/bin/python -m avspec.serving.host.launcher \
    --model-repository model_repository --draft-model models/draft --target-model models/target \
    --engine llamacpp --engine-threads $threads --http-port 8100 --grpc-port 8101 --metrics-port 8102 \
    > /tmp/serve_$name.log 2>&1 &
  pid=$!
  for i in $(seq 1 400); do grep -q "avspec: serving" /tmp/serve_$name.log && break; sleep 1; done
  .venv/bin/python client/bench_openai.py --url http://127.0.0.1:8100 --endpoint chat --workloads chat \
    --concurrency 1,16 --requests 16 --warmup-requests 8 --max-tokens 64 --temperature 0.7 --top-p 0.95 \
    --out $out/$name.json > $out/$name.txt 2>&1
  kill -INT $pid; wait $pid
}
run spin2 2 ""
run passive2 2 PASSIVE
run spin1 1 ""
run spin2_again 2 ""
