#!/usr/bin/env bash
# Install what is needed, then run lint, the layering contracts (import-linter, see
# pyproject.toml), the unit tests, the engine contract suite and the end-to-end tests (real vLLM
# behind Ray Serve; one engine for the whole session).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source scripts/env.sh
export RAY_USAGE_STATS_ENABLED=0
"$PY" -m ruff check .
# The console script next to this interpreter (no `python -m` entry point exists).
"$(dirname "$PY")/lint-imports"
# The slowest tests, so that the suite's time (CI keeps it near 30 minutes) can be watched.
exec "$PY" -m pytest -ra --durations=30 "$@"
