#!/usr/bin/env bash
# Install what is needed, then run lint, the unit tests and the end-to-end tests (real vLLM
# behind Ray Serve; one engine for the whole session).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY="${PYTHON:-python3}"
export RAY_USAGE_STATS_ENABLED=0
"$PY" -m ruff check .
exec "$PY" -m pytest -ra "$@"
