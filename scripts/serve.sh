#!/usr/bin/env bash
# Install what is needed, then start the gateway on the embedded default model (port 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/env.sh
export RAY_USAGE_STATS_ENABLED=0
# Serve settings the gateway needs in the environment Ray starts with (gateway/serve_env.py).
eval "$("$PY" -m gateway.serve_env)"
exec "$(dirname "$PY")/serve" run "${1:-serve_config.yaml}"
