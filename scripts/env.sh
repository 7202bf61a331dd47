# Sourced by install.sh, serve.sh and test.sh: picks the Python environment everything goes into.
#   1. $PYTHON, if set (an interpreter you chose);
#   2. the active virtualenv or conda environment;
#   3. otherwise `.venv` in the checkout, created here. It sees the system's site-packages, so a
#      torch or vLLM that the machine's image already ships (CUDA builds are gigabytes) is reused
#      rather than downloaded again, but everything installed goes into `.venv`: the system
#      interpreter is never written to.
# Exports PY (the interpreter) and puts its bin directory first on PATH (ray, serve, lint-imports).
if [ -n "${PYTHON:-}" ]; then
  PY="$PYTHON"
elif [ -n "${VIRTUAL_ENV:-}" ] && [ -x "$VIRTUAL_ENV/bin/python" ]; then
  PY="$VIRTUAL_ENV/bin/python"
elif [ -n "${CONDA_PREFIX:-}" ] && [ -x "$CONDA_PREFIX/bin/python" ]; then
  PY="$CONDA_PREFIX/bin/python"
else
  _venv="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.venv"
  if [ ! -x "$_venv/bin/python" ]; then
    echo "[env] no virtualenv active: creating $_venv (activate another one to install there)"
    # Without a pip of its own when the system has one: a venv's bundled setuptools would
    # shadow the system's and get upgraded past what vLLM pins.
    if python3 -m pip --version >/dev/null 2>&1; then
      python3 -m venv --system-site-packages --without-pip "$_venv"
    else
      python3 -m venv --system-site-packages "$_venv"
    fi
  fi
  PY="$_venv/bin/python"
fi
export PY
PATH="$(dirname "$PY"):$PATH"
export PATH
