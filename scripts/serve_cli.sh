#!/usr/bin/env bash
# Serve's CLI on a cluster node, from the environment scripts/install.sh installed into:
#   ray exec cluster.yaml 'bash ~/llm-gateway/scripts/serve_cli.sh deploy serve_config.cluster.yaml'
#   ray exec cluster.yaml 'bash ~/llm-gateway/scripts/serve_cli.sh status'
# Runs in the checkout (relative config paths resolve there). Ray's token authentication: a
# cluster whose nodes share ~/.ray/auth_token (cluster.yaml copies yours to every node) only
# answers clients that send it, and Serve's CLI sends it only in token mode.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
if [ -z "${RAY_AUTH_MODE:-}" ] && [ -s "$HOME/.ray/auth_token" ]; then
  export RAY_AUTH_MODE=token
fi
exec "$(dirname "$PY")/serve" "$@"
