#!/usr/bin/env bash
# Served tokens/s with the cost tables in git (another host's, December 3) against this host's,
# measured by the launcher at first start (issue 32, item 5): chat, 128 tokens, c=1,16; the
# default pair as `make serve` runs it; arms in the order given (ABBA). PREFIX=llamacpp_
# ENGINE_ARGS="--engine llamacpp" for llama.cpp's engine.
cd "$(dirname "$0")/../.."
out=bench/host_costs; mkdir -p $out
run() {  # name [launcher options...]
  name=$1; shift
  .venv/bin/python -m avspec.serving.host.launcher --model-repository model_repository \
    --draft-model models/draft --target-model models/target \
    --http-port 8100 --grpc-port 8101 --metrics-port 8102 "$@" > /tmp/serve_$name.log 2>&1 &
  pid=$!
  for i in $(seq 1 300); do grep -q "avspec: serving" /tmp/serve_$name.log && break; sleep 1; done
  grep "cost tables\|engine" /tmp/serve_$name.log > $out/$name.server.txt
  .venv/bin/python client/bench_openai.py --url http://127.0.0.1:8100 --endpoint chat --workloads chat \
    --concurrency 1,16 --requests 16 --warmup-requests 8 --max-tokens 128 --temperature 0.7 --top-p 0.95 \
    --out $out/$name.json > $out/$name.txt 2>&1
  kill -INT $pid; wait $pid
}
run ${PREFIX}recorded_a --cost-tables models/cost_tables.json $ENGINE_ARGS
run ${PREFIX}host_a $ENGINE_ARGS
run ${PREFIX}host_b $ENGINE_ARGS
run ${PREFIX}recorded_b --cost-tables models/cost_tables.json $ENGINE_ARGS
