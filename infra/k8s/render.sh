#!/usr/bin/env bash
# docs/kubernetes.md: one manifest of infra/k8s/ with this cluster's settings, printed for `kubectl apply -f -`:
#   bash infra/k8s/render.sh infra/k8s/worker.yaml | kubectl apply -f -
# Reads infra/k8s/cluster.env (EAGLE3_CLUSTER_ENV=<file> for another; copy it from cluster.env.example, step 0;
# a variable the caller exported wins over the file's),
# then place.py fills each ${VAR} of the manifest: the CPU placement (EAGLE3_CPU_NODE_SELECTOR/_TOLERATIONS) of
# every pod, the in-cluster API URL, the volumes' storage classes and sizes, and what the step exports
# (EAGLE3_IMAGE, MODEL_REPO, ...). An unset variable stops it, naming the variable; nothing is applied half-filled.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$here/cluster-env.sh"
exec python3 "$here/place.py" manifest "${1:?usage: render.sh infra/k8s/<manifest>.yaml}"
