"""The project's log lines in a Serve replica's own log file.

Serve writes a replica's log (``logs/serve/replica_<app>_<deployment>_<id>.log``, with the
replica and request ids) through the ``ray.serve`` logger only, and it does not propagate; the
root logger of a replica has no handler, so an ``INFO`` line of this project (an engine's
placement, a replica's channel, a monitor's decision) went nowhere, and a warning only to the
worker's stderr file. :func:`log_with_serve` hands this project's loggers Serve's handlers.
"""

from __future__ import annotations

import logging

__all__ = ["PROJECT_LOGGERS", "log_with_serve"]

PROJECT_LOGGERS = ("engines", "gateway", "protocols")


def log_with_serve(level: int = logging.INFO) -> None:
    """From now on, this process's project loggers write where Serve's do (call it in a
    replica's constructor; outside a replica Serve's logger has no handler, and nothing
    changes)."""
    handlers = logging.getLogger("ray.serve").handlers
    if not handlers:
        return
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = list(handlers)
        logger.setLevel(level)
        logger.propagate = False
