"""Controller calls under aicirt's time bounds (``docs/protocols/aici.md``, "Time bounds").

Every call runs on a worker thread and may use ``Limits.step_s`` of CPU time, within
``Limits.wall_factor`` times that of wall time (:meth:`CallRunner.run` says why CPU time). A
``mid_process`` that overruns leaves its row all-allowed (a no-op step, logged), and
``Limits.max_timeout_steps`` of those in a row fail the sequence; ``pre_process`` /
``post_process`` change the controller's state, so one that overruns fails the sequence at once
(its late effect could not be undone). A call still running from an earlier step is not started
again: that step counts as another timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

import msgspec

from engines.controllers.api.base import Controller, ControllerError
from engines.controllers.runtime.sequence import ControlledSequence

__all__ = ["CallRunner", "Calls", "Limits", "Outcome"]


@dataclass(frozen=True)
class Limits:
    step_s: float = 0.025  # aicirt's --wasm-max-step-time default: CPU time of one call
    # ... and, however a call spends it (blocked, or waiting for a core or the GIL), this many
    # times that in wall time
    wall_factor: float = 4.0
    init_s: float = 1.0  # --wasm-max-init-time
    max_timeout_steps: int = 10  # --wasm-max-timeout-steps
    max_forks: int = 16  # --wasm-max-forks, per request
    max_arg_bytes: int = 1 << 20  # controller_arg, and the prompt as given
    max_pending: int = 1024  # live controllers (instantiated, not yet released)
    pending_ttl_s: float = 600.0  # one idle (no segment running) this long is dropped
    workers: int = 8


class Outcome(msgspec.Struct, frozen=True, gc=False):
    """What one controller call gave: its value, or the error that failed it ("" when it did
    not fail), and the microseconds it ran. (A Struct: made for every call of every step, and
    cheaper to make than a NamedTuple.)"""

    value: Any
    error: str
    micros: int


# The calls of one phase of a step, by any key the caller chooses (a sequence id, a row).
Calls = dict[Any, tuple[ControlledSequence, Callable[[], Any]]]


class CallRunner:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._pool = ThreadPoolExecutor(limits.workers, thread_name_prefix="aici-ctrl")
        # Calls cut at their bound, by kind, since the start (the runtime's ``get_stats``).
        self._timeouts = {"mid": 0, "pre_post": 0}
        self._counting = threading.Lock()  # the main channel's thread and the side's pool

    def timeouts_so_far(self) -> dict[str, int]:
        with self._counting:
            return dict(self._timeouts)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def run(self, calls: Calls, stateful: bool) -> dict[Any, Outcome]:
        """Run each call on the pool; a call is cut once it used ``step_s`` of CPU time, or
        when ``wall_factor * step_s`` of wall time passed since the step began.

        CPU time, not wall time, is a controller's own: aicirt runs each sequence in a
        process of its own, here they share one (and its GIL), and the engine sends a step
        before its forward pass so the runtime works while the engine computes, on cores that
        the forward pass and vLLM's other processes also want. A wall bound alone charged a
        controller for the others' time and for the box's load (at 16 llguidance streams
        some overran 25 ms, had an unconstrained step and failed); the wall cap still bounds a
        controller that blocks instead of computing."""
        out: dict[Any, Outcome] = {}
        futures: dict[Any, Future] = {}
        clocks: dict[Any, list] = {}
        began = time.monotonic()
        for key, (seq, call) in calls.items():
            if seq.running is not None and not seq.running.done():
                out[key] = self._timed_out(seq, stateful, still_running=True)
                continue
            if _is_default(call):  # the base class's no-op: no thread handoff for nothing
                out[key] = Outcome(_timed(call).value, "", 0)
                continue
            clocks[key] = []
            seq.running = futures[key] = self._pool.submit(_timed, call, clocks[key])
        if futures:
            self._wait(futures, clocks, began)
        for key, fut in futures.items():
            seq = calls[key][0]
            if not fut.done():
                out[key] = self._timed_out(seq, stateful, still_running=False)
                continue
            seq.running = None
            seq.timeouts = 0
            outcome = fut.result()
            seq.micros += outcome.micros
            if outcome.error:
                seq.fail(outcome.error)
            out[key] = outcome
        return out

    def _wait(self, futures: dict[Any, Future], clocks: dict[Any, list], began: float) -> None:
        """Until every call is done, over its CPU budget, or the step's wall cap passed."""
        step = self.limits.step_s
        cap = began + step * self.limits.wall_factor
        wait_all(futures.values(), timeout=step)  # most steps end here
        while True:
            within = [fut for key, fut in futures.items()
                      if not fut.done() and _cpu_used(clocks[key]) < step]
            now = time.monotonic()
            if not within or now >= cap:
                return
            wait_all(within, timeout=min(step / 4, cap - now))

    def _timed_out(self, seq: ControlledSequence, stateful: bool,
                   still_running: bool) -> Outcome:
        bound, micros = f"{self.limits.step_s * 1000:g} ms", int(self.limits.step_s * 1e6)
        seq.micros += micros
        with self._counting:
            self._timeouts["pre_post" if stateful else "mid"] += 1
        if stateful:
            return Outcome(None, seq.fail(f"controller step took longer than {bound}"), micros)
        seq.timeouts += 1
        if seq.timeouts >= self.limits.max_timeout_steps:
            why = f"controller took longer than {bound} in {seq.timeouts} steps in a row"
            return Outcome(None, seq.fail(why), micros)
        seq.ctx.log(f"timeout: mid_process {'still running' if still_running else 'over'} "
                    f"{bound}; this step is unconstrained")
        return Outcome(None, "", micros)


_DEFAULTS = frozenset({Controller.pre_process, Controller.mid_process, Controller.post_process})


def _is_default(call: Callable[[], Any]) -> bool:
    method = getattr(call, "func", call)  # functools.partial of a bound method, or the method
    return getattr(method, "__func__", None) in _DEFAULTS


def _timed(call: Callable[[], Any], clock: list | None = None) -> Outcome:
    if clock is not None:  # this thread's CPU clock and its reading now, for _cpu_used
        try:
            clock_id = time.pthread_getcpuclockid(threading.get_ident())
            clock += [clock_id, time.clock_gettime(clock_id)]
        except (AttributeError, OSError):  # no per-thread CPU clock: the wall cap bounds it
            pass
    t0 = time.perf_counter()
    try:
        value, error = call(), ""
    except ControllerError as exc:
        value, error = None, str(exc)
    except Exception as exc:  # a controller bug fails its sequence, not the runtime
        value, error = None, f"{type(exc).__name__}: {exc}"
    return Outcome(value, error, int((time.perf_counter() - t0) * 1e6))


def _cpu_used(clock: list) -> float:
    """CPU seconds the call behind ``clock`` used so far (0 while it waits for a thread)."""
    if not clock:
        return 0.0
    try:
        return time.clock_gettime(clock[0]) - clock[1]
    except OSError:  # the thread is gone: the call is over
        return float("inf")
