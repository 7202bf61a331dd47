"""HAProxy rules that send a request naming a model straight to that model's own application.

Each model served by its own application (``gateway.model_replica.ingress``) has the route prefix
``/model/<name>``, which Serve renders into HAProxy's configuration. For every such prefix,
:func:`model_rules` gives ``http-request`` rules that read the model a request names (the JSON
body's top-level ``model`` on the paths a protocol declares in ``ProtocolSpec.model_in_body``,
the path segment after a ``ProtocolSpec.model_in_path`` prefix) and, when it is that model,
put the prefix in front of the path, so that Serve's own routing rules pick the model's backend.
Requests named otherwise, or not at all, keep their path (the gateway application). The body is
read only as far as HAProxy's buffer (``tune.bufsize``) holds it: a ``model`` past that is not
seen, and the request takes the gateway application's route (served the same, one hop slower).
A body that has neither filled the buffer nor ended ``LLM_GATEWAY_HAPROXY_BODY_WAIT_S`` (60)
seconds after its headers is answered 408 in the protocol's shape.
docs/cluster.md, "The default layout".
"""

from __future__ import annotations

import re

from gateway.model_routes import MODEL_ROUTE, model_of_route
from gateway.shapes import ErrorShapes

__all__ = ["BODY_WAIT_VAR", "DEFAULT_BODY_WAIT_S", "MODEL_VAR", "model_rules"]

MODEL_VAR = "txn.llm_gateway_model"
# Names written into HAProxy's configuration as they are: no spaces, quotes, '#', '%' or '\'.
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9._:@+/-]+$")
# How long (seconds) HAProxy waits for a request's body to read its model. When the wait runs out
# HAProxy answers 408 (its rule, not a fallback to the gateway's route), so it only bounds a
# client that stalls: a loaded client takes seconds between headers and body (CI's burst of 900
# on two cores got 408s at 2 s). nginx allows a body 60 s between reads (client_body_timeout).
BODY_WAIT_VAR = "LLM_GATEWAY_HAPROXY_BODY_WAIT_S"
DEFAULT_BODY_WAIT_S = 60


def _served(route_prefixes: list[str]) -> list[str]:
    names = {model_of_route(p) for p in route_prefixes} - {None}
    return sorted(n for n in names if _PLAIN_NAME.match(n))


def model_rules(route_prefixes: list[str], shapes: ErrorShapes,
                body_wait_s: int = DEFAULT_BODY_WAIT_S) -> list[str]:
    """``http-request`` rules for the public frontend (none when no prefix is a model's)."""
    names = _served(route_prefixes)
    if not names:
        return []
    body_paths = sorted({p for spec in shapes.owners for p in spec.model_in_body})
    unset = f"!{{ var({MODEL_VAR}) -m found }}"
    rules = []
    if body_paths:
        named = f"METH_POST {{ path {' '.join(body_paths)} }}"
        rules += [f"http-request wait-for-body time {body_wait_s}s if {named}",
                  f"http-request set-var({MODEL_VAR}) req.body,json_query('$.model') if {named}"]
    by_depth: dict[int, list[str]] = {}
    for spec in shapes.owners:
        for prefix in spec.model_in_path:
            # "/v2/models/<name>/...": the name is field 4 of the path split at '/'.
            by_depth.setdefault(prefix.count("/") + 1, []).append(prefix)
    for field, prefixes in sorted(by_depth.items()):
        rules.append(f"http-request set-var({MODEL_VAR}) path,field({field},/),url_dec "
                     f"if {{ path_beg {' '.join(sorted(prefixes))} }} {unset}")
    for name in names:
        rules.append(f"http-request set-path {MODEL_ROUTE}{name}%[path] "
                     f"if {{ var({MODEL_VAR}) -m str {name} }}")
    return rules
