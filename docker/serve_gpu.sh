#!/usr/bin/env bash
# Container entry point: fill the GPU templates, then serve both repositories with the gpu configs.
# Values: AVSPEC_GPU_VALUES (a JSON file, default the example) plus `--set name=value` arguments.
set -euo pipefail
ROOT=/opt/avspec
FILLED="${ROOT}/build/model_repository_gpu"
python3 "${ROOT}/client/fill_template.py" --force --output "${FILLED}" \
    --values "${AVSPEC_GPU_VALUES:-${ROOT}/docker/gpu_values.example.json}" "$@"
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
