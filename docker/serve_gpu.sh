#!/usr/bin/env bash
# Container entry point: build the target engine if the engine volume has none, fill the GPU
# templates, then serve both repositories with the gpu configs through the launcher
# (avspec.serving.launcher): tritonserver on 127.0.0.1 behind the front, restricted APIs and the
# stage supervisor, as in the CPU deployment (docs/serving.md, "What a client can reach").
# Values: AVSPEC_GPU_VALUES (a JSON file, default the example) plus `--set name=value` arguments
# (those reach the templates only; the engine build reads the values file).
# Admin APIs stay closed unless AVSPEC_ADMIN_KEY_FILE names a key file (first line, at least 16
# characters) or AVSPEC_ADMIN_KEY holds the key (read by the launcher itself).
# AVSPEC_HTTP_PORT / AVSPEC_GRPC_PORT / AVSPEC_METRICS_PORT move the public ports (tests; the
# image exposes and compose maps the defaults 8000 / 8001 / 8002).
set -euo pipefail
ROOT="${AVSPEC_ROOT:-/opt/avspec}"
FILLED="${ROOT}/build/model_repository_gpu"
VALUES="${AVSPEC_GPU_VALUES:-${ROOT}/docker/gpu_values.example.json}"
value() { python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))[sys.argv[2]])' "${VALUES}" "$1"; }

ENGINE_DIR="$(value engine_dir)"
if [[ ! -f "${ENGINE_DIR}/rank0.engine" ]]; then
    # First start: export models/target as a TensorRT-LLM checkpoint and build it (minutes).
    echo "no engine in ${ENGINE_DIR}: building one from ${ROOT}/models/target"
    python3 -m avspec.trtllm.checkpoint "${ROOT}/models/target" --out /tmp/avspec_checkpoint \
        --force --dtype float16 --build "${ENGINE_DIR}" \
        --max-batch-size "$(value triton_max_batch_size)" --max-seq-len "$(value max_seq_len)"
fi

python3 "${ROOT}/client/fill_template.py" --force --output "${FILLED}" --values "${VALUES}" "$@"
mkdir -p "${ROOT}/runs"

# Triton's layout: <prefix>/bin/tritonserver and <prefix>/backends (/opt/tritonserver in the image).
TRITONSERVER="$(command -v tritonserver || echo /opt/tritonserver/bin/tritonserver)"
BACKENDS="$(dirname "$(dirname "${TRITONSERVER}")")/backends"
ADMIN=()
if [[ -n "${AVSPEC_ADMIN_KEY_FILE:-}" ]]; then
    ADMIN=(--admin-key-file "${AVSPEC_ADMIN_KEY_FILE}")
fi
# --ready-timeout-secs: loading the engine on the first start can take minutes.
exec python3 -m avspec.serving.launcher \
    --tritonserver "${TRITONSERVER}" --backend-directory "${BACKENDS}" \
    --model-repository "${ROOT}/model_repository" \
    --model-repository "${FILLED}" \
    --model-config-name gpu \
    --load-model=tensorrt_llm --load-model=trtllm_target \
    --load-model=draft --load-model=verifier \
    --load-model=speculative_step --load-model=speculative \
    --host 0.0.0.0 --http-port "${AVSPEC_HTTP_PORT:-8000}" \
    --grpc-port "${AVSPEC_GRPC_PORT:-8001}" --metrics-port "${AVSPEC_METRICS_PORT:-8002}" \
    --exit-timeout-secs 30 --ready-timeout-secs 900 \
    "${ADMIN[@]}"
