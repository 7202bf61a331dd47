"""HAProxy's own answers in the protocol's shape: Serve's real template rendered by Serve's own
``HAProxyApi``, shaped by ``llm-gateway-haproxy``'s rewrite, served by the real HAProxy binary
(the one ``ray[serve]`` bundles). The oracle is the other layout: the body Serve's proxy gives
for the same path and status (``gateway/edge/proxy.py``, through the same ``ErrorShapes``)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid

import httpx
import psutil
import pytest

from gateway.edge import haproxy_errors
from gateway.edge.haproxy_errors import OWN_MARK, real_binary, shape_config
from gateway.serve_env import free_port
from gateway.shapes import DIED, RESTARTING, ErrorShapes

SHAPES = ErrorShapes.of_every_protocol()



HEALTHY = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\nsuccess"


class _Replica:
    """A stand-in for an ingress replica's HTTP server: each connection on a thread."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connection, args=(conn,), daemon=True).start()

    def _connection(self, conn):
        raise NotImplementedError


class _DyingReplica(_Replica):
    """Answers Serve's health check (and ``GET /dying/warm``) on a kept-alive connection;
    closes the connection on every other request before answering (a replica that died with
    the request in flight: HAProxy's 502)."""

    def _connection(self, conn):
        with conn, contextlib.suppress(OSError):  # HAProxy may reset a health check's
            while conn.recv(65536).startswith((b"GET /-/healthz", b"GET /dying/warm")):
                conn.sendall(HEALTHY)


class _SlowReplica(_Replica):
    """Never answers; counts the requests whose connection HAProxy closed."""

    def __init__(self):
        self.closed = 0
        super().__init__()

    def _connection(self, conn):
        with conn:
            if conn.recv(65536).startswith(b"GET /-/healthz"):
                conn.sendall(HEALTHY)
                return
            conn.settimeout(30)
            try:
                while conn.recv(65536):  # the rest of the request; then b"" or a reset
                    pass
            except OSError:
                pass
            self.closed += 1


class _ServesProxy(http.server.ThreadingHTTPServer):
    """Serve's proxy beside HAProxy: says which path reached it."""

    class _Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = f"serve's proxy: {self.path}".encode()
            self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    def __init__(self):
        super().__init__(("127.0.0.1", 0), self._Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


def _render(directory: str, port: int, apps: dict[str, int]) -> str:
    """Serve's own rendering of its HAProxy configuration for ``apps`` (route prefix -> port)."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(socket_path=os.path.join(directory, "admin.sock"),
                        enable_hap_optimization=False, stats_port=free_port(),
                        metrics_port=free_port(), metrics_enabled=False,
                        http_options=HTTPOptions(host="127.0.0.1", port=port))
    backends = {prefix: BackendConfig(name=f"http-app{i}", path_prefix=prefix, app_name=f"app{i}",
                                      servers=[ServerConfig(f"r{i}", "127.0.0.1", server_port)])
                for i, (prefix, server_port) in enumerate(apps.items())}
    path = os.path.join(directory, "haproxy.cfg")
    HAProxyApi(cfg, backends, config_file_path=path)._generate_config_file_internal()
    return path


def start_haproxy(directory: str, apps: dict[str, int],
                  fallback_port: int) -> tuple[subprocess.Popen, str]:
    """HAProxy started as Serve starts it, through the launcher, on Serve's rendering for
    ``apps`` (route prefix -> replica port); paths of no app go to ``fallback_port``."""
    port = free_port()
    config = _render(directory, port, apps)
    env = {**os.environ, haproxy_errors.BINARY_VAR: real_binary(),
           haproxy_errors.FALLBACK_PORT_VAR: str(fallback_port)}
    proc = subprocess.Popen([*_LAUNCHER, "-db", "-f", config], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    _wait_listening(url, proc)
    return proc, url


_LAUNCHER = [os.path.join(os.path.dirname(sys.executable), haproxy_errors.LAUNCHER)]


def _wait_listening(url: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            httpx.get(url + "/-/routes", timeout=1)
            return
        except httpx.TransportError:
            assert proc.poll() is None, (proc.stderr.read() or b"").decode()[-3000:]
            time.sleep(0.1)
    pytest.fail(f"HAProxy did not listen on {url} within 20 s")


@pytest.fixture(scope="module")
def haproxy_and_slow(tmp_path_factory):
    """HAProxy started as Serve starts it, through the launcher, for: /gw (no replica up),
    /dying (a replica that closes every request)."""
    directory = str(tmp_path_factory.mktemp("haproxy"))
    dying, slow = _DyingReplica(), _SlowReplica()
    serves_proxy = _ServesProxy()
    proc, url = start_haproxy(directory, {"/gw": free_port(), "/dying": dying.port,
                                          "/slow": slow.port}, serves_proxy.server_port)
    yield url, slow
    proc.terminate()
    proc.wait(10)
    dying.listener.close()
    slow.listener.close()
    serves_proxy.shutdown()


@pytest.fixture(scope="module")
def haproxy(haproxy_and_slow) -> str:
    return haproxy_and_slow[0]


def _expected(path: str, status: int, message: str) -> tuple[int, str, bytes]:
    response = SHAPES.response(path, status, message)
    return response.status_code, response.headers["content-type"], bytes(response.body)


@pytest.mark.parametrize("path", ["/gw/v1/completions", "/gw/v1/chat/completions", "/gw/generate",
                                  "/gw/generate_stream", "/gw/v2/models/m/generate_stream",
                                  "/gw/invocations", "/gw/v1/run", "/gw/v1/controllers",
                                  "/gw/tokenize", "/gw/anything", "/gw/v1/messages"])
def test_no_replica_is_a_503_in_the_paths_shape_with_retry_after(haproxy, path):
    # Anthropic's paths get its 529 (overloaded_error) instead.
    got = httpx.post(haproxy + path, json={"inputs": "x"}, timeout=30)
    assert (got.status_code, got.headers["content-type"], got.content) == _expected(
        path, 503, RESTARTING)
    assert got.headers["retry-after"] == "1" and OWN_MARK not in got.headers


def test_haproxys_own_answers_carry_the_clients_request_id_or_a_new_one(haproxy):
    def ids(**headers) -> list[str]:
        got = httpx.post(haproxy + "/gw/v1/completions", json={}, headers=headers, timeout=30)
        assert got.status_code == 503
        return got.headers.get_list("x-request-id")

    assert ids(**{"x-request-id": "client-7.a"}) == ["client-7.a"]
    fresh = [ids(), ids(**{"x-request-id": "not plain, with spaces"})]
    assert all(len(one) == 1 and uuid.UUID(one[0]).version == 4 for one in fresh), fresh
    assert fresh[0] != fresh[1]


@pytest.mark.parametrize("path", ["/dying/v1/completions", "/dying/generate", "/dying/v1/run",
                                  "/dying/v1/messages"])
def test_a_replica_that_dies_before_answering_is_a_503_in_shape(haproxy, path):
    got = httpx.post(haproxy + path, json={"prompt": "x"}, timeout=30)
    assert (got.status_code, got.headers["content-type"], got.content) == _expected(
        path, 503, DIED)
    assert got.headers["retry-after"] == "1"
    if got.headers["content-type"] == "application/json":
        json.loads(got.content)


def test_a_replica_that_dies_after_answering_on_a_kept_alive_connection_still_gets_a_503(haproxy):
    # HAProxy closes the client's connection without a word when a replica closes a *reused*
    # connection before answering; the launcher gives each request a connection of its own.
    with httpx.Client(timeout=30) as first:
        assert first.get(haproxy + "/dying/warm").status_code == 200
    with httpx.Client(timeout=30) as second:
        got = second.post(haproxy + "/dying/v1/completions", json={"prompt": "x"})
    assert (got.status_code, got.content) == _expected("/dying/v1/completions", 503, DIED)[::2]


def test_a_client_that_leaves_closes_its_replicas_connection_every_time(haproxy_and_slow):
    # Serve's template spliced request bodies, and HAProxy then kept the replica's connection
    # (its generation) open for a client that had left, 3 times in 6.
    url, slow = haproxy_and_slow
    for left in range(1, 7):
        try:
            got = httpx.post(url + "/slow/v1/completions", json={"prompt": "x"}, timeout=0.5)
            raise AssertionError(got.text)
        except httpx.TimeoutException:
            pass
        deadline = time.monotonic() + 10
        while slow.closed < left and time.monotonic() < deadline:
            time.sleep(0.05)
        assert slow.closed == left


def test_a_path_no_application_has_goes_to_serves_proxy_on_the_node(haproxy_and_slow):
    # Serve's proxy knows the routes while HAProxy's are being rebuilt (an application being
    # redeployed drops out of them), and answers a path nobody has with its shaped 404.
    url, _ = haproxy_and_slow
    got = httpx.post(url + "/elsewhere/v1/completions", json={}, timeout=30)
    assert (got.status_code, got.text) == (404, "serve's proxy: /elsewhere/v1/completions")


def test_serves_own_endpoints_are_left_as_they_are(haproxy):
    # Serve's /-/routes and /-/healthz answer load balancers in Serve's own words (here: the
    # route table a bare HAProxyApi never marks populated).
    for path in ("/-/routes", "/-/healthz"):
        got = httpx.get(haproxy + path, timeout=30)
        assert got.status_code == 503 and got.headers["content-type"] == "text/plain", path
        assert got.text == "Route table is not populated yet." and "retry-after" not in got.headers


def test_a_configuration_without_serves_frontend_is_left_unchanged():  # another template
    text = "global\n    maxconn 10\nfrontend other\n    bind :1\n"
    assert shape_config(text, "/tables", SHAPES) == text


def test_the_owner_rules_follow_the_proxys_choice_of_shape():
    rules = haproxy_errors.owner_rules(["/", "/pipeline"], SHAPES)
    # the whole path first, then below each route prefix, then any suffix; a default last
    assert rules[0].endswith("if { path / } !{ var(txn.llm_gateway_protocol) -m found }")
    assert any("{ path_beg /pipeline/v1/controllers/ }" in rule for rule in rules)
    assert rules.index(next(r for r in rules if "path_beg /pipeline/v1/controllers/" in r)) < \
        rules.index(next(r for r in rules if "path_beg /pipeline/v1/ " in r))
    assert rules[-1].startswith(f"http-request set-var(txn.llm_gateway_protocol) "
                                f"str({SHAPES.owners[0].name}) if !")


class _StreamingReplica(_Replica):
    """Streams ten chunks, one every 0.2 s, to each request that is not a health check."""

    def _connection(self, conn):
        with conn, contextlib.suppress(OSError):
            if conn.recv(65536).startswith(b"GET /-/healthz"):
                conn.sendall(HEALTHY)
                return
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(10):
                time.sleep(0.2)
                conn.sendall(b"2\r\n%02d\r\n" % i)
            conn.sendall(b"0\r\n\r\n")


# Serve's HAProxy manager, as far as HAProxy can tell: starts it, says its pid, then waits.
_STARTER = """
import subprocess, sys, time
print(subprocess.Popen(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid,
      flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # its new parent may not reap
    except psutil.NoSuchProcess:
        return True


def _stream(url: str, chunks: list[bytes], first: threading.Event) -> None:
    with httpx.stream("POST", url, json={}, timeout=30) as response:
        for chunk in response.iter_raw():
            chunks.append(chunk)
            first.set()


def test_haproxy_ends_with_the_process_that_started_it_and_frees_the_port(tmp_path):
    # A manager that is killed cannot stop its HAProxy: that HAProxy kept the public port, and
    # the manager Serve started next failed to bind it ("Address already in use"). HAProxy
    # soft-stops instead: the port is free at once, the stream in flight still ends whole.
    replica, port = _StreamingReplica(), free_port()
    config = _render(str(tmp_path), port, {"/s": replica.port})
    starter = subprocess.Popen([sys.executable, "-c", _STARTER, *_LAUNCHER, "-db", "-f", config],
                               env={**os.environ, haproxy_errors.BINARY_VAR: real_binary()},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    haproxy_pid = int(starter.stdout.readline())
    try:
        _wait_listening(f"http://127.0.0.1:{port}", starter)
        assert psutil.Process(haproxy_pid).exe() == os.path.realpath(real_binary())
        chunks, first = [], threading.Event()
        reader = threading.Thread(target=_stream, daemon=True,
                                  args=(f"http://127.0.0.1:{port}/s/v1/completions", chunks, first))
        reader.start()
        assert first.wait(10)
        starter.kill()
        starter.wait(10)
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_server(("127.0.0.1", port)):
                break  # the next HAProxy can bind the port
            time.sleep(0.05)
        else:
            pytest.fail("HAProxy kept the port after the process that started it was killed")
        reader.join(10)
        assert b"".join(chunks) == b"".join(b"%02d" % i for i in range(10))
        deadline = time.monotonic() + 5
        while not _gone(haproxy_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(haproxy_pid), "HAProxy outlived the process that started it"
    finally:
        starter.kill()
        replica.listener.close()
        with contextlib.suppress(psutil.NoSuchProcess):
            psutil.Process(haproxy_pid).kill()


def test_an_application_with_an_ingress_request_router_is_shaped_into_a_valid_configuration(
        tmp_path):
    """A model routed by prefix has an ingress request router (gateway/model_replica/router.py):
    Serve then renders a second backend per application for the requests its router pinned,
    with no path ACL of its own. The shaped configuration bounds that backend under its
    application's ACL and passes HAProxy's own check."""
    from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
    from ray.serve.config import HTTPOptions

    cfg = HAProxyConfig(socket_path=str(tmp_path / "admin.sock"), enable_hap_optimization=False,
                        stats_port=free_port(), metrics_port=free_port(), metrics_enabled=False,
                        http_options=HTTPOptions(host="127.0.0.1", port=free_port()))
    replicas = [ServerConfig(f"SERVE_REPLICA_m-engine-{i}", "127.0.0.1", free_port(),
                             replica_id=f"SERVE_REPLICA::m#engine#{i}") for i in range(2)]
    backends = {"/model/m": BackendConfig(
        name="http-m", path_prefix="/model/m", app_name="m", servers=replicas,
        ingress_request_router_servers=[ServerConfig("router", "127.0.0.1", free_port())])}
    path = tmp_path / "haproxy.cfg"
    HAProxyApi(cfg, backends, config_file_path=str(path))._generate_config_file_internal()
    shaped = tmp_path / "shaped.cfg"
    shaped.write_text(shape_config(path.read_text(), str(tmp_path), SHAPES))
    haproxy_errors.write_tables(str(tmp_path), SHAPES)
    assert "lua.route_via_ingress_request_router" in shaped.read_text()
    bound = [line for line in shaped.read_text().splitlines()
             if "be_conn(http-m-via-ingress-request-router)" in line]
    assert len(bound) == 1 and "is_http-m " in bound[0], bound
    pinned = shaped.read_text().split("backend http-m-via-ingress-request-router\n", 1)[1]
    assert pinned.splitlines()[0].strip() == "retry-on conn-failure empty-response"
    check = subprocess.run([real_binary(), "-c", "-f", str(shaped)], capture_output=True,
                           text=True, cwd=tmp_path)
    assert check.returncode == 0, check.stderr[-2000:]
