#!/usr/bin/env bash
# Step 7 of docs/kubernetes.md: the two Kubernetes work pools, created or overwritten (same result every time),
# before `prefect --no-prompt deploy --all --prefect-file infra/k8s/prefect.yaml` (which needs them to exist).
#   eagle3-gpu  infra/k8s-gpu-job-template.json; concurrency limit = EAGLE3_GPU_NODES x EAGLE3_GPU_JOBS_PER_NODE:
#               the GPU gate on Kubernetes. A flow run beyond it waits in the pool (Late/Pending) before any pod
#               exists, instead of a pod holding a node's GPUs while it waits for a slot inside (EAGLE3_GPU_GATE=pool
#               in the pods: the in-pod slot honours the pool's gate). Whole-node jobs (TP 8, world size 8): 1 per node.
#   eagle3-cpu  infra/k8s-cpu-job-template.json (the pipeline flow's pod, verify); limit EAGLE3_CPU_JOBS (default 8).
# Environment: PREFECT_API_URL (+ PREFECT_API_AUTH_STRING) of the server; EAGLE3_GPU_NODES (required).
set -euo pipefail
: "${EAGLE3_GPU_NODES:?set EAGLE3_GPU_NODES to the number of GPU nodes the pipeline may use (docs/kubernetes.md step 7)}"
infra=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gpu_limit=$((EAGLE3_GPU_NODES * ${EAGLE3_GPU_JOBS_PER_NODE:-1}))
prefect work-pool create eagle3-gpu --type kubernetes --base-job-template "$infra/k8s-gpu-job-template.json" --overwrite
prefect work-pool set-concurrency-limit eagle3-gpu "$gpu_limit"
prefect work-pool create eagle3-cpu --type kubernetes --base-job-template "$infra/k8s-cpu-job-template.json" --overwrite
prefect work-pool set-concurrency-limit eagle3-cpu "${EAGLE3_CPU_JOBS:-8}"
prefect work-pool ls
