#!/usr/bin/env bash
# Install what is needed, then start the gateway on the embedded default model (port 8000).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_USAGE_STATS_ENABLED=0
exec serve run "${1:-serve_config.yaml}"
