#!/usr/bin/env bash
# Container entry point: build the target engine if the engine volume has none (the Hugging Face
# target through TensorRT-LLM's stock converter and trtllm-build, avspec.trtllm.hf_engine;
# docs/gpu.md "Your own pair on the GPU"), fill the GPU
# templates, then serve both repositories with the gpu configs through the launcher
# (avspec.serving.host.launcher): tritonserver on Unix sockets behind the front, the server dropped to
# its own user, the stage supervisor and restarts, as in the CPU deployment (docs/serving.md,
# "What a client can reach"). AVSPEC_SERVER_USER picks that user (default uid 10001; the NGC
# image's own non-root user is triton-server, uid 1000).
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

# The pair: AVSPEC_TARGET_MODEL / AVSPEC_DRAFT_MODEL (directories inside the container), by
# default models/target and models/draft. TRTLLM_EXAMPLES: TensorRT-LLM's examples (the stock
# Hugging Face converters), by default where docker/Dockerfile puts them.
TARGET="${AVSPEC_TARGET_MODEL:-${ROOT}/models/target}"
DRAFT="${AVSPEC_DRAFT_MODEL:-${ROOT}/models/draft}"
export TRTLLM_EXAMPLES="${TRTLLM_EXAMPLES:-/opt/tensorrt_llm/examples}"
CHECKPOINT="${AVSPEC_CHECKPOINT_DIR:-/tmp/avspec_checkpoint}"

ENGINE_DIR="$(value engine_dir)"
SIZES=(--max-batch-size "$(value triton_max_batch_size)" --max-seq-len "$(value max_seq_len)")
if [[ ! -f "${ENGINE_DIR}/rank0.engine" ]]; then
    # First start: TensorRT-LLM's stock converter, then trtllm-build (minutes). hf_engine refuses
    # a target that is not a Hugging Face checkpoint, naming the directory, before converting.
    echo "no engine in ${ENGINE_DIR}: building one from ${TARGET}"
    python3 -m avspec.trtllm.hf_engine "${TARGET}" --out "${CHECKPOINT}" \
        --dtype float16 --build "${ENGINE_DIR}" "${SIZES[@]}"
fi

# the engine's vocabulary is the target's config.json vocab_size
VOCAB="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
    "${TARGET}/config.json")"
FILL=(--set "vocab_size=${VOCAB}")
# the launcher checks the pair and serves the draft and verifier on it (model_dir, vocab_limit,
# caps, pair_id), as `make serve DRAFT_MODEL=... TARGET_MODEL=...` does
PAIR=(--draft-model "${DRAFT}" --target-model "${TARGET}")

python3 "${ROOT}/client/fill_template.py" --force --output "${FILLED}" --values "${VALUES}" \
    "${FILL[@]}" "$@"
mkdir -p "${ROOT}/runs"

# Triton's layout: <prefix>/bin/tritonserver and <prefix>/backends (/opt/tritonserver in the image).
TRITONSERVER="$(command -v tritonserver || echo /opt/tritonserver/bin/tritonserver)"
BACKENDS="$(dirname "$(dirname "${TRITONSERVER}")")/backends"
ADMIN=()
if [[ -n "${AVSPEC_ADMIN_KEY_FILE:-}" ]]; then
    ADMIN=(--admin-key-file "${AVSPEC_ADMIN_KEY_FILE}")
fi
# --ready-timeout-secs: loading the engine on the first start can take minutes.
USER_ARG=()
if [[ -n "${AVSPEC_SERVER_USER:-}" ]]; then
    USER_ARG=(--user "${AVSPEC_SERVER_USER}")
fi
exec python3 -m avspec.serving.host.launcher \
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
    "${ADMIN[@]}" "${USER_ARG[@]}" "${PAIR[@]}"
