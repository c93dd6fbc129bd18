# Sourced by render.sh and pools.sh: loads infra/k8s/cluster.env (EAGLE3_CLUSTER_ENV=<file> for another; step 0
# copies it from cluster.env.example) into the environment; a variable the caller exported wins over the file's.
env_file=${EAGLE3_CLUSTER_ENV:-$here/cluster.env}
[[ -f "$env_file" ]] || { echo "$env_file not found: cp infra/k8s/cluster.env.example infra/k8s/cluster.env and edit it (docs/kubernetes.md step 0)" >&2; exit 2; }
given=$(export -p)  # what the caller exported wins over the file
set -a; . "$env_file"; set +a
eval "$given" 2>/dev/null || true  # (a read-only variable stays as it is)
