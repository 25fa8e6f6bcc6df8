#!/usr/bin/env bash
# tritonserver under MPI for a tensor-parallel target (TensorRT-LLM's launch_triton_server.py
# recipe): rank 0 is the launcher's server with every argument it was given (front, draft,
# verifier, Python stages, TensorRT-LLM rank 0); ranks 1..N-1 load only the TensorRT-LLM model
# and serve nothing. Multi-node (LeaderWorkerSet, AVSPEC_MPI_NODES pods per group): the hosts are
# the group's pods, named by LeaderWorkerSet (leader LWS_LEADER_ADDRESS, workers
# <name>-<group>-<i>.<name>), N / nodes slots each; the workers run sshd (docs/scale_out.md).
set -euo pipefail
REAL="${AVSPEC_REAL_TRITONSERVER:-/opt/tritonserver/bin/tritonserver}"
N="${AVSPEC_TP_SIZE:?}"
KEEP=()
for arg in "$@"; do
    case "${arg}" in
        --model-repository=*|--backend-directory=*|--model-config-name=*) KEEP+=("${arg}") ;;
    esac
done
HOSTS=()
NODES="${AVSPEC_MPI_NODES:-1}"
if (( NODES > 1 )); then
    PER=$(( N / NODES ))
    LIST="${LWS_LEADER_ADDRESS:?}:${PER}"
    for (( i = 1; i < NODES; i++ )); do
        LIST+=",${AVSPEC_LWS_NAME}-${LWS_GROUP_INDEX:?}-${i}.${AVSPEC_LWS_NAME}:${PER}"
    done
    HOSTS=(--host "${LIST}")
fi
COMMAND=(mpirun --allow-run-as-root "${HOSTS[@]}" -n 1 "${REAL}" "$@")
for (( rank = 1; rank < N; rank++ )); do
    COMMAND+=(: -n 1 "${REAL}" "${KEEP[@]}" --model-control-mode=explicit
        --load-model=tensorrt_llm --disable-auto-complete-config
        --allow-http=false --allow-grpc=false --allow-metrics=false
        "--backend-config=python,shm-region-prefix-name=avspec_rank${rank}_")
done
exec "${COMMAND[@]}"
