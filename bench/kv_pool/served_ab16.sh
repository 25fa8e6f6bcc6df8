#!/bin/bash
# A/B at concurrency 16: old tree (e8c918c: fixed slots, no chunked prefill) vs new, ABAB
set -u
run() {  # $1 label, $2 tree
  cd $2 && PYTHONPATH=$2/backend timeout 900 /work/main/.venv/bin/python client/bench_llamacpp.py \
    --start-project torch --model-repository $2/model_repository \
    --draft-model /work/main/models/draft --target-model /work/main/models/target \
    --llama-python /work/main/build/xllamacpp-venv/bin/python --gguf /work/main/models/target/model.gguf \
    --flash-attn --concurrency 16 --requests 48 --warmup-requests 16 --rounds 1 --max-tokens 128 \
    --out /tmp/ab16/$1 2>&1 | grep "round 1 concurrency" | sed "s/^/$1 /"
}
mkdir -p /tmp/ab16
for r in 1 2; do run old$r /tmp/oldtree; run new$r /work/main; done
