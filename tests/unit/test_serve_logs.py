"""This project's log lines in a Serve replica's log file (engines/replica/serve_logs.py), also after
an engine's start reconfigured logging (vLLM's import runs ``logging.config.dictConfig``)."""

import logging
import logging.config
import logging.handlers

import pytest

from engines.replica.serve_logs import PROJECT_LOGGERS, keeping_serve_logs, log_with_serve


@pytest.fixture
def serve_log(tmp_path):
    """A replica's logging as Serve sets it up: a buffering handler over the log file."""
    path = tmp_path / "replica.log"
    serve = logging.getLogger("ray.serve")
    saved = (serve.handlers, serve.level, serve.propagate,
             {n: (logging.getLogger(n).handlers, logging.getLogger(n).level,
                  logging.getLogger(n).propagate) for n in PROJECT_LOGGERS})
    buffer = logging.handlers.MemoryHandler(1, target=logging.FileHandler(path),
                                            flushLevel=logging.ERROR)
    serve.handlers, serve.propagate = [buffer], False
    serve.setLevel(logging.INFO)
    yield path
    serve.handlers, serve.level, serve.propagate, loggers = saved
    for name, (handlers, level, propagate) in loggers.items():
        logger = logging.getLogger(name)
        logger.handlers, logger.level, logger.propagate = handlers, level, propagate


def test_project_lines_and_serves_own_survive_a_logging_reconfiguration(serve_log):
    log_with_serve()
    logging.getLogger("engines.replica.host").info("before the engine")
    with keeping_serve_logs():
        logging.config.dictConfig({"version": 1, "disable_existing_loggers": False})
    logging.getLogger("engines.replica.host").info("after the engine")
    logging.getLogger("ray.serve").info("an access line")
    assert serve_log.read_text().splitlines() == ["before the engine", "after the engine",
                                                  "an access line"]


def test_project_lines_follow_handlers_serve_replaced(serve_log, tmp_path):
    log_with_serve()
    other = tmp_path / "new.log"
    logging.getLogger("ray.serve").handlers = [logging.FileHandler(other)]
    logging.getLogger("gateway.app").info("to the new file")
    assert other.read_text() == "to the new file\n"
    assert serve_log.read_text() == ""
