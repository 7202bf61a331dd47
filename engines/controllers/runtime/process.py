"""A controller runtime in a process of its own: a child of the engine replica, not a Ray actor.

Ray's core worker wakes every Ray worker's main thread 100 times a second to check for signals
(docs/results/benchmarks-2026-12-07.md, "Ray's signal check"), so as a Ray actor each model's
runtime spent about 0.006 CPU-s/s doing nothing, on the core that serves. A plain child waits on
its channels' semaphores and nothing else. Its controllers' Python still takes neither the
replica's GIL nor its CPU time.

The replica starts it before its engine (the engine's hook asks the runtime ``tokens`` while
vLLM builds its logits processors) and waits until it serves or says why it cannot. The replica
ends it by closing its stdin; a replica that dies closes it too, and its reaper
(engines/kit/reaper.py) ends it with vLLM's processes after a kill. Its log lines go to the
replica's stderr, where Ray keeps the replica's. Its metrics travel over the side channel
(``get_stats``, engines/controllers/runtime/service.py).

    python -m engines.controllers.runtime.process MODEL   (a RuntimeStart as JSON on stdin, one line)
"""

from __future__ import annotations

import logging
import os
import select
import signal
import subprocess
import sys
import time
from typing import IO

import msgspec

from engines.controllers.runtime.calls import Limits

__all__ = ["RuntimeProcess", "RuntimeStart", "main"]

log = logging.getLogger(__name__)


class RuntimeStart(msgspec.Struct):
    """What the replica tells its runtime process: the channels' names and what it serves."""

    prefix: str
    model_dir: str
    vocab_size: int
    custom: dict[str, str]
    limits: Limits


class RuntimeReady(msgspec.Struct, omit_defaults=True):
    """The process's one line back: serving, or why it is not."""

    error: str = ""


class RuntimeProcess:
    """The replica's handle on its runtime process, which serves once this returns (or this
    raises, saying why). :meth:`close` ends it."""

    def __init__(self, model: str, start: RuntimeStart, ready_s: float = 120.0) -> None:
        # The same imports as the replica's (a Ray runtime_env's working_dir, an operator's
        # controllers): its sys.path, not only what the interpreter finds by itself.
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self._proc = subprocess.Popen([sys.executable, "-m", "engines.controllers.runtime.process", model],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        try:
            self._proc.stdin.write(msgspec.json.encode(start) + b"\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
            line = _line_within(self._proc.stdout, ready_s)  # type: ignore[arg-type]
            if not line:
                raise RuntimeError(f"the controller runtime of {model!r} exited with "
                                   f"{self._proc.wait(5)} before it served (its log is above)")
            ready = msgspec.json.decode(line, type=RuntimeReady)
            if ready.error:
                raise RuntimeError(f"the controller runtime of {model!r} did not start: "
                                   f"{ready.error}")
        except BaseException:
            self.close()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def close(self) -> None:
        """Close its stdin (it closes its channels and exits); kill it after 5 s."""
        try:
            self._proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc.stdout.close()  # type: ignore[union-attr]


def _line_within(stream: IO[bytes], seconds: float) -> bytes:
    """One line from ``stream`` (b"" at its end), or TimeoutError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no answer within {seconds:g} s")
        ready, _, _ = select.select([stream], [], [], left)
        if ready:
            return stream.readline()


def main(argv: list[str]) -> int:
    from engines.controllers.runtime.service import RuntimeService

    model = argv[0] if argv else "?"
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=(
        f"%(asctime)s %(levelname)s controller runtime [{model}] %(name)s: %(message)s"))
    # A terminal's Ctrl-C reaches the whole process group: the replica decides when this ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    answer = os.fdopen(os.dup(1), "wb")  # the handshake's; stray prints go to stderr
    os.dup2(2, 1)
    try:
        start = msgspec.json.decode(sys.stdin.buffer.readline(), type=RuntimeStart)
        service = RuntimeService(start.prefix, start.model_dir, start.vocab_size, start.custom,
                                 start.limits)
    except Exception as exc:
        log.exception("could not start")
        answer.write(msgspec.json.encode(RuntimeReady(error=f"{type(exc).__name__}: {exc}")))
        answer.write(b"\n")
        answer.close()
        return 1
    answer.write(msgspec.json.encode(RuntimeReady()) + b"\n")
    answer.close()
    sys.stdin.buffer.read()  # until the replica closes it, or dies
    service.close()
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    os._exit(code)  # not waiting on a controller call still stuck in the runtime's pool
