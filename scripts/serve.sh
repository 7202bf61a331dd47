#!/usr/bin/env bash
# Install what is needed, then start the gateway on the embedded default model (port 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/env.sh
export RAY_USAGE_STATS_ENABLED=0
# Errors Serve's proxy writes itself (an ingress replica that died, a proxy timeout) come in
# the protocol's shape; this needs to be in Ray's environment when it starts.
export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH="${RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH:-gateway.proxy:middlewares}"
exec "$(dirname "$PY")/serve" run "${1:-serve_config.yaml}"
