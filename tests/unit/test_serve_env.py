"""gateway/serve_env.py: the one place that says which environment Ray must start with."""

import os
import subprocess
import sys
from pathlib import Path

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
