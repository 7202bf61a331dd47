"""Waiting on other processes in tests."""

from __future__ import annotations

import time

import psutil


def gone_within(pid: int, seconds: float) -> bool:
    """Whether process ``pid`` exited (or is a zombie, its exit not yet collected) within
    ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False
