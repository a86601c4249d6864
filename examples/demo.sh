#!/usr/bin/env bash
# The demo: start the local stack (API + controller + local Ray, SQLite under var/) unless one
# already answers, run examples/tiny.yaml to the end, and say where the dashboard is.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}
SERVER=${TRIDENT_SERVER:-http://127.0.0.1:8000}
PORT=${SERVER##*:}
mkdir -p var
if ! curl -fsS "$SERVER/api/v1/healthz" >/dev/null 2>&1; then
  echo "starting the local stack (log: var/trident.log)"
  nohup "$BIN/trident" up --port "$PORT" --data-dir var >var/trident.log 2>&1 &
  echo $! >var/trident.pid
  for _ in $(seq 1 120); do
    curl -fsS "$SERVER/api/v1/healthz" >/dev/null 2>&1 && break
    sleep 1
  done
  curl -fsS "$SERVER/api/v1/healthz" >/dev/null || { echo "the API did not start"; cat var/trident.log; exit 1; }
fi
"$BIN/trident" submit examples/tiny.yaml --server "$SERVER"
echo
echo "dashboard: $SERVER/   (REST: $SERVER/api/v1/jobs, OpenAPI: $SERVER/docs)"
echo "log in with the admin's token in var/admin.token (trident token create makes others)"
echo "the stack keeps running; 'make stop' ends it"
