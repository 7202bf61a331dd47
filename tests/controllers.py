"""Test controllers and a fake tokenizer for the controller runtime and the engine hook."""

from __future__ import annotations

import time

import msgspec
import numpy as np

from engines.controllers.api.base import Controller, ControllerError, PreResult
from engines.controllers.runtime.runtime import ControllerRuntime

VOCAB = 64


def as_wire(answer):
    """A runtime answer as the engine end reads it off the shared memory: decoded JSON."""
    return msgspec.json.decode(msgspec.json.encode(answer))


class WireRuntime(ControllerRuntime):
    """The runtime with its answers in their wire form, for tests that read them whole."""

    def handle_main(self, cmd):
        return as_wire(super().handle_main(cmd))

    def handle_side(self, request, reply):
        super().handle_side(request, lambda answer: reply(as_wire(answer)))


class FakeTokenizer:
    vocab_size = VOCAB
    eos_token_id = 0

    def encode(self, text: str) -> list[int]:
        return [b % VOCAB for b in text.encode()]

    def decode(self, tokens: list[int]) -> bytes:
        return bytes(tokens)


class Scripted(Controller):
    """arg = JSON-free mini script: ``allow=5`` (only token 5), ``ff=1,2``, ``forks=2``,
    ``stop-after=3``, ``slow-mid=0.2`` (sleeps), ``busy-mid=0.2`` (computes: that much CPU
    time), ``slow-post=0.2``, ``raise-mid``, ``var=x``,
    ``wait=x`` (suspended until variable ``x`` is set; with ``wait-branch=i`` only branch i of a
    fork waits), ``branch-ff`` (after a fork, branch i
    forces token 100 + i once)."""

    def __init__(self, ctx, arg, prompt):
        super().__init__(ctx, arg, prompt)
        self.opts = dict(part.partition("=")[::2] for part in arg.split() if part)
        if "bad" in self.opts:
            raise ControllerError("bad program")
        self.seen: list[int] = []
        self.branch: int | None = None  # after a fork: which branch this is
        self.branch_ff_done = False

    def forked(self, index):
        self.branch = index

    def pre_process(self):
        waits = "wait-branch" not in self.opts or self.branch == int(self.opts["wait-branch"])
        if "wait" in self.opts and waits and self.ctx.get_var(self.opts["wait"]) is None:
            return PreResult(suspend=True)
        if "branch-ff" in self.opts and self.branch is not None and not self.branch_ff_done:
            self.branch_ff_done = True
            return PreResult(ff_tokens=[100 + self.branch])
        ff = [int(t) for t in self.opts.get("ff", "").split(",") if t] if not self.seen else []
        forks = int(self.opts.get("forks", 1)) if not self.seen and self.branch is None else 1
        return PreResult(num_forks=forks, ff_tokens=ff)

    def mid_process(self):
        if "slow-mid" in self.opts:
            time.sleep(float(self.opts["slow-mid"]))
        if "busy-mid" in self.opts:
            until = time.thread_time() + float(self.opts["busy-mid"])
            while time.thread_time() < until:
                pass
        if "raise-mid" in self.opts:
            raise RuntimeError("controller bug")
        if "allow" not in self.opts:
            return None
        allowed = np.zeros(VOCAB, dtype=bool)
        allowed[int(self.opts["allow"])] = True
        return allowed

    def post_process(self, tokens, backtrack):
        if "slow-post" in self.opts:
            time.sleep(float(self.opts["slow-post"]))
        if backtrack:
            del self.seen[-backtrack:]
        self.seen += tokens
        if "var" in self.opts:
            self.ctx.set_var(self.opts["var"], bytes(tokens), append=True)
            self.ctx.log(f"wrote {tokens}")
        return len(self.seen) >= int(self.opts.get("stop-after", 10**9))


class Backtracking(Scripted):
    """``after=k back=n ff=a,b``: once ``k`` tokens are in, withdraw the last ``n`` and force
    ``a, b`` (a splice, then sampling goes on)."""

    def pre_process(self):
        if len(self.seen) == int(self.opts["after"]) and not getattr(self, "spliced", False):
            self.spliced = True
            ff = [int(t) for t in self.opts.get("ff", "").split(",") if t]
            return PreResult(backtrack=int(self.opts["back"]), ff_tokens=ff)
        return PreResult()
