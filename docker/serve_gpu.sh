#!/usr/bin/env bash
# Container entry point: build the target engine if the engine volume has none, fill the GPU
# templates, then serve both repositories with the gpu configs.
# Values: AVSPEC_GPU_VALUES (a JSON file, default the example) plus `--set name=value` arguments
# (those reach the templates only; the engine build reads the values file).
set -euo pipefail
ROOT="${AVSPEC_ROOT:-/opt/avspec}"
FILLED="${ROOT}/build/model_repository_gpu"
VALUES="${AVSPEC_GPU_VALUES:-${ROOT}/docker/gpu_values.example.json}"
value() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "${VALUES}" "$1"; }

ENGINE_DIR="$(value engine_dir)"
if [[ ! -f "${ENGINE_DIR}/rank0.engine" ]]; then
    # First start: export models/target as a TensorRT-LLM checkpoint and build it (minutes).
    echo "no engine in ${ENGINE_DIR}: building one from ${ROOT}/models/target"
    python3 -m avspec.trtllm_checkpoint "${ROOT}/models/target" --out /tmp/avspec_checkpoint \
        --force --dtype float16 --build "${ENGINE_DIR}" \
        --max-batch-size "$(value triton_max_batch_size)" --max-seq-len "$(value max_seq_len)"
fi

python3 "${ROOT}/client/fill_template.py" --force --output "${FILLED}" --values "${VALUES}" "$@"
mkdir -p "${ROOT}/runs"
exec tritonserver \
    --model-repository="${ROOT}/model_repository" \
    --model-repository="${FILLED}" \
    --model-config-name=gpu \
    --model-control-mode=explicit \
    --load-model=tensorrt_llm --load-model=trtllm_target \
    --load-model=draft --load-model=verifier \
    --load-model=speculative_step --load-model=speculative \
    --http-port=8000 --grpc-port=8001 \
    --allow-metrics=true --metrics-port=8002 \
    --exit-timeout-secs=30
