"""The project's log lines in a Serve replica's own log file.

Serve writes a replica's log (``logs/serve/replica_<app>_<deployment>_<id>.log``, with the
replica and request ids) through the ``ray.serve`` logger only, and it does not propagate; the
root logger of a replica has no handler, so an ``INFO`` line of this project (an engine's
placement, a replica's channel, a monitor's decision) went nowhere, and a warning only to the
worker's stderr file. :func:`log_with_serve` hands this project's loggers Serve's handlers.
"""

from __future__ import annotations

import logging
import logging.handlers
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PROJECT_LOGGERS", "keeping_serve_logs", "log_with_serve"]

PROJECT_LOGGERS = ("engines", "gateway", "protocols")


class _ToServe(logging.Handler):
    """Hands each record to the handlers Serve's logger has *now*: Serve replaces them when it
    configures the replica's logging again (copies taken at start wrote to a closed file after
    that: the lines reached the worker's stderr file only)."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger("ray.serve").handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def log_with_serve(level: int = logging.INFO) -> None:
    """From now on, this process's project loggers write where Serve's do (call it in a
    replica's constructor; outside a replica Serve's logger has no handler, and nothing
    changes)."""
    if not logging.getLogger("ray.serve").handlers:
        return
    for name in PROJECT_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers = [_ToServe()]
        logger.setLevel(level)
        logger.propagate = False


@contextmanager
def keeping_serve_logs() -> Iterator[None]:
    """Serve's replica log file still written after the block (an engine's start).

    Importing vLLM configures logging with ``logging.config.dictConfig``, which closes every
    handler of the process, Serve's too: Serve's buffering handler then drops what it is
    given, and a vLLM replica's log file ended at its first lines (its access lines and this
    project's reached only the worker's stderr file). The buffering handlers get their file
    handlers back, which reopen the file on their next line."""
    kept = [(handler, handler.target) for handler in logging.getLogger("ray.serve").handlers
            if isinstance(handler, logging.handlers.MemoryHandler)]
    try:
        yield
    finally:
        for handler, target in kept:
            if handler.target is None and target is not None:
                handler.target = target

