#!/usr/bin/env bash
# Step 7 of docs/kubernetes.md: the two Kubernetes work pools, created or overwritten (same result every time),
# before `prefect --no-prompt deploy --all --prefect-file infra/k8s/prefect.yaml` (which needs them to exist).
#   eagle3-gpu  infra/k8s-gpu-job-template.json; concurrency limit = EAGLE3_GPU_NODES x EAGLE3_GPU_JOBS_PER_NODE:
#               the GPU gate on Kubernetes. A flow run beyond it waits in the pool (Late/Pending) before any pod
#               exists, instead of a pod holding a node's GPUs while it waits for a slot inside (EAGLE3_GPU_GATE=pool
#               in the pods: the in-pod slot honours the pool's gate). Whole-node jobs (TP 8, world size 8): 1 per node.
#   eagle3-cpu  infra/k8s-cpu-job-template.json (the pipeline flow's pod, verify); limit EAGLE3_CPU_JOBS (default 8).
# Reads infra/k8s/cluster.env (EAGLE3_CLUSTER_ENV=<file> for another; step 0 copies it from cluster.env.example;
# a variable the caller exported wins over the file's):
# EAGLE3_GPU_NODES (required), the node placement of your platform as JSON over the templates' defaults
# (EAGLE3_GPU_NODE_SELECTOR, EAGLE3_GPU_TOLERATIONS, EAGLE3_CPU_NODE_SELECTOR, EAGLE3_CPU_TOLERATIONS),
# EAGLE3_GPUS_PER_NODE and EAGLE3_CLUSTER_API_URL (place.py). The workstation's PREFECT_API_URL
# (+ PREFECT_API_AUTH_STRING) names the server these commands talk to.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/cluster-env.sh"
: "${EAGLE3_GPU_NODES:?set EAGLE3_GPU_NODES in $env_file to the number of GPU nodes the pipeline may use (docs/kubernetes.md step 0)}"
infra=$(cd "$here/.." && pwd)
gpu_limit=$((EAGLE3_GPU_NODES * ${EAGLE3_GPU_JOBS_PER_NODE:-1}))
placed=$(mktemp -d)
trap 'rm -rf "$placed"' EXIT
for kind in gpu cpu; do  # the templates with this cluster's placement as their defaults
  python3 "$infra/k8s/place.py" template "$infra/k8s-$kind-job-template.json" "$kind" > "$placed/$kind.json"
done
prefect work-pool create eagle3-gpu --type kubernetes --base-job-template "$placed/gpu.json" --overwrite
prefect work-pool set-concurrency-limit eagle3-gpu "$gpu_limit"
prefect work-pool create eagle3-cpu --type kubernetes --base-job-template "$placed/cpu.json" --overwrite
prefect work-pool set-concurrency-limit eagle3-cpu "${EAGLE3_CPU_JOBS:-8}"
prefect work-pool ls
