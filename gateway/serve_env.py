"""The environment Ray must start with for the gateway, in one place.

Serve's proxy, controller and replicas read these when they import Serve, so they have to be in
the environment of ``ray start`` / ``ray.init`` / ``serve run``, not in an application's
runtime env. ``scripts/serve.sh`` and ``scripts/ray_node.sh`` export them
(``eval "$(python -m gateway.serve_env)"``), the test session and the benchmarks call
:func:`apply`. A value already in the environment wins, so each can be overridden.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import MutableMapping

__all__ = ["SERVE_ENV", "apply"]

SERVE_ENV: dict[str, str] = {
    # Errors Serve's proxy writes itself (an ingress replica that died, a proxy timeout) come
    # in the protocol's shape (gateway/proxy.py).
    "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "gateway.proxy:middlewares",
}


def apply(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """Set every entry of :data:`SERVE_ENV` that ``env`` (default ``os.environ``) lacks."""
    env = os.environ if env is None else env
    for key, value in SERVE_ENV.items():
        env.setdefault(key, value)
    return env


def main() -> None:
    for key, value in SERVE_ENV.items():
        print(f'export {key}="${{{key}:-{shlex.quote(value)}}}"')


if __name__ == "__main__":
    main()
