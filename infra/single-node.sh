#!/usr/bin/env bash
# One GPU node, as the users run it (docs/single-node.md): a Prefect server with its UI (SQLite under
# $PREFECT_HOME, kept between runs), the process work pool and the gpu-node limit (one slot: one node), the
# deployments of prefect.yaml, one process worker on this node, then a run of the `pipeline` deployment with
# CONFIG, followed here until it ends. Idempotent: a server or worker this script started before is reused.
# `make run CONFIG=configs/kimi-k2.5-tp8.yaml` calls it on a GPU machine.
set -euo pipefail
CONFIG=${1:?usage: infra/single-node.sh CONFIG.yaml}
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
export PATH="$PWD/$VENV/bin:$PATH" EAGLE3_PIPELINE_HOME="$PWD"
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.prefect}
export PREFECT_LOCAL_STORAGE_PATH=${PREFECT_LOCAL_STORAGE_PATH:-$PREFECT_HOME/storage}
PORT=${EAGLE3_UI_PORT:-4200}
HOST=${EAGLE3_UI_HOST:-0.0.0.0}
export PREFECT_API_URL=${PREFECT_API_URL:-http://127.0.0.1:$PORT/api}
mkdir -p "$PREFECT_HOME/logs"

python - "$CONFIG" <<'EOF'
import sys
from eagle3_pipeline.core.config import load_config
load_config(sys.argv[1])  # a bad config fails here, in seconds, before any server or worker starts
EOF

up() { curl -fsS "$PREFECT_API_URL/health" >/dev/null 2>&1; }
if ! up; then
  echo "single-node: starting the Prefect server (UI on http://$HOST:$PORT, log $PREFECT_HOME/logs/server.log)"
  nohup prefect server start --host "$HOST" --port "$PORT" >>"$PREFECT_HOME/logs/server.log" 2>&1 &
  echo $! >"$PREFECT_HOME/server.pid"
  for _ in $(seq 180); do up && break; sleep 1; done
  up || { echo "single-node: the server did not answer in 180 s; see $PREFECT_HOME/logs/server.log" >&2; exit 5; }
fi

prefect work-pool inspect eagle3-process >/dev/null 2>&1 || prefect work-pool create eagle3-process --type process
prefect gcl inspect gpu-node >/dev/null 2>&1 || prefect gcl create gpu-node --limit 1
prefect --no-prompt deploy --all >>"$PREFECT_HOME/logs/deploy.log" 2>&1 \
  || { echo "single-node: prefect deploy failed; see $PREFECT_HOME/logs/deploy.log" >&2; exit 5; }

worker_pid="$PREFECT_HOME/worker.pid"
if ! { [ -f "$worker_pid" ] && kill -0 "$(cat "$worker_pid")" 2>/dev/null; }; then
  echo "single-node: starting a process worker (log $PREFECT_HOME/logs/worker.log)"
  PREFECT_CLIENT_RETRY_EXTRA_CODES=500 nohup prefect worker start --pool eagle3-process \
    >>"$PREFECT_HOME/logs/worker.log" 2>&1 &
  echo $! >"$worker_pid"
fi

echo "single-node: running the pipeline deployment on $CONFIG; follow it in the UI at http://$HOST:$PORT"
exec prefect deployment run pipeline/pipeline --param "config_path=$CONFIG" --watch
