#!/usr/bin/env bash
# Pod entry point (ConfigMap <release>-avspec-scripts, rendered by the chart): check K, give this
# pod's estimator its warm start from the shared prior, prepare tensor parallelism, then run the
# image's own entry point, docker/serve_gpu.sh (engine build on first start, templates, launcher).
set -euo pipefail
ROOT="${AVSPEC_ROOT:-/opt/avspec}"

# K is baked into the image's verifier config; the chart's value must agree.
CONFIG="${ROOT}/model_repository/verifier/configs/gpu.pbtxt"
K_IMAGE="$(sed -n 's/.*"num_positions".*string_value: "\([0-9]*\)".*/\1/p' "${CONFIG}")"
if [[ "${AVSPEC_NUM_DRAFT_TOKENS}" != "${K_IMAGE}" ]]; then
    echo "speculative.numDraftTokens=${AVSPEC_NUM_DRAFT_TOKENS}, but the image's verifier has" \
        "num_positions=${K_IMAGE} (${CONFIG}): set the value to ${K_IMAGE} or build an image" \
        "with that K" >&2
    exit 2
fi

# /opt/avspec/models is this pod's: the cost tables the verifier reads, from a ConfigMap or from
# the models claim (mounted read-only at /mnt/models).
mkdir -p "${ROOT}/models"
ln -sf "${AVSPEC_COST_TABLES}" "${ROOT}/models/cost_tables_gpu.json"

# One estimator per pod: its snapshot lives in the pod's runs volume; the first start copies the
# read-only prior there, later container restarts keep what the pod has learnt.
SNAPSHOT="${ROOT}/runs/estimator_snapshot.json"
if [[ -n "${AVSPEC_PRIOR:-}" && ! -f "${SNAPSHOT}" ]]; then
    cp "${AVSPEC_PRIOR}" "${SNAPSHOT}"
    echo "estimator warm start: ${AVSPEC_PRIOR} -> ${SNAPSHOT}"
fi

TP="${AVSPEC_TP_SIZE:-1}"
if (( TP > 1 )); then
    ENGINE_DIR="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["engine_dir"])' \
        "${AVSPEC_GPU_VALUES}")"
    if [[ ! -f "${ENGINE_DIR}/rank$((TP - 1)).engine" ]]; then
        # the same converter and trtllm-build as serve_gpu.sh, with the weights split TP ways
        read -r BATCH SEQ < <(python3 -c 'import json, sys; v = json.load(open(sys.argv[1]));
print(v["triton_max_batch_size"], v["max_seq_len"])' "${AVSPEC_GPU_VALUES}")
        python3 -m avspec.trtllm.hf_engine "${AVSPEC_TARGET_MODEL}" \
            --out "/tmp/avspec_checkpoint_tp${TP}" --build "${ENGINE_DIR}" --dtype float16 \
            --max-batch-size "${BATCH}" --max-seq-len "${SEQ}" --tp-size "${TP}"
    fi
    # tritonserver through MPI: serve_gpu.sh finds the wrapper first on PATH; Triton's backends
    # stay where they are (serve_gpu.sh takes <prefix>/backends beside <prefix>/bin)
    mkdir -p /tmp/avspec-tp/bin
    ln -sfn "$(dirname "$(dirname "$(command -v tritonserver || echo /opt/tritonserver/bin/x)")")/backends" \
        /tmp/avspec-tp/backends
    install -m 0755 /etc/avspec/scripts/tritonserver_mpi.sh /tmp/avspec-tp/bin/tritonserver
    export AVSPEC_REAL_TRITONSERVER="$(command -v tritonserver || echo /opt/tritonserver/bin/tritonserver)"
    export PATH="/tmp/avspec-tp/bin:${PATH}"
fi
exec bash "${ROOT}/docker/serve_gpu.sh"
