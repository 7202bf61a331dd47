"""What a controller is: one sequence's per-step hook, in the seed's three phases (ABI v1).

The runtime (``engines/controllers/runtime/runtime.py``) calls, per engine step and per sequence:

- ``pre_process()`` before scheduling: suspend this step, fork into N, stop (``num_forks=0``),
  or force tokens (``ff_tokens``, appended without sampling), after withdrawing the last
  ``backtrack`` tokens of the output (beyond the seed's pre result: AICI's v1 put a backtrack
  in ``mid_process``'s Splice, v2 in a branch's splice; here every edit of the sequence is
  decided in one place, before the step);
- ``mid_process()`` while the engine computes logits: which tokens may be sampled (``None`` =
  any), returned rather than written so a call that overruns its time bound cannot touch the
  next step's rows;
- ``post_process(tokens, backtrack)`` after sampling: the tokens appended (sampled or forced),
  after ``backtrack`` were removed; ``True`` stops the sequence.

Controllers are trusted Python classes registered by name (built-ins in
``engines/controllers/runtime/builtin.py``; operators add theirs in the Serve config). A fork is a deep
copy; forks of one request share its variables (``ControllerContext.get_var`` / ``set_var``),
which the runtime reports as the seed's ``storage`` ``WriteVar`` entries.
"""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import msgspec
import numpy as np
from msgspec import UNSET

from engines.controllers.ipc.messages import PreState

Arg = TypeVar("Arg")

__all__ = ["Controller", "ControllerContext", "ControllerError", "PreResult", "TokenizerInfo",
           "Variables"]


class ControllerError(Exception):
    """The user's controller argument or program is wrong: reported as a user error (the
    sequence fails with this message, in the protocol's shape); anything else a controller
    raises is a controller failure."""


def json_arg(controller: str, arg: str, kind: type[Arg], usage: str) -> Arg:
    """A controller's ``controller_arg`` (JSON) as its own type ``kind``; otherwise a
    :class:`ControllerError` naming ``controller``: the parser's message when it is not JSON,
    ``usage`` when it does not have ``kind``'s shape."""
    try:
        value = json.loads(arg)
    except json.JSONDecodeError as exc:
        raise ControllerError(f"{controller}: controller_arg is not JSON: {exc}") from None
    try:
        return msgspec.convert(value, kind)
    except msgspec.ValidationError:
        raise ControllerError(f"{controller}: {usage}") from None


class TokenizerInfo(Protocol):
    """What controllers may know of the model's tokenizer."""

    vocab_size: int  # rows of the logits (the model's, which may exceed the tokenizer's)
    eos_token_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> bytes: ...


@dataclass
class PreResult:
    suspend: bool = False
    num_forks: int = 1
    ff_tokens: list[int] = field(default_factory=list)
    backtrack: int = 0  # output tokens withdrawn before ff_tokens are appended

    def state(self) -> PreState:
        """A copy as the runtime's message type (the controller may reuse this object)."""
        return PreState(self.suspend, self.num_forks, list(self.ff_tokens), self.backtrack or UNSET)


class Variables:
    """A request's shared variables: all its forks see the same."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._lock = threading.Lock()  # forks run on different runtime threads

    def get(self, name: str) -> bytes | None:
        return self._values.get(name)

    def write(self, name: str, value: bytes, append: bool) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, b"") + value if append else value


class ControllerContext:
    """Per sequence: the tokenizer, the request's variables, and what the current call logged
    and stored (drained into that call's ``SequenceResult``). The same entries also go to a
    journal the frontend reads between segments (:meth:`journal`): the engine's hook, which
    receives the per-step results, has no client to give them to."""

    def __init__(self, tokenizer: TokenizerInfo, variables: Variables,
                 controllers: Callable[[str], Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.variables = variables
        # The runtime's controllers by tag or module id (a factory, or None): how a controller
        # that runs another one (``engines.controllers.runtime.reasoning``) finds it.
        self.controllers = controllers or (lambda module: None)
        self._logs: list[str] = []
        self._storage: list[dict] = []
        self._journal_logs: list[str] = []
        self._journal_storage: list[dict] = []

    def log(self, text: str) -> None:
        line = text if text.endswith("\n") else text + "\n"
        self._logs.append(line)
        self._journal_logs.append(line)

    def get_var(self, name: str) -> bytes | None:
        return self.variables.get(name)

    def set_var(self, name: str, value: bytes | str, append: bool = False) -> None:
        raw = value.encode() if isinstance(value, str) else bytes(value)
        self.variables.write(name, raw, append)
        entry = {"WriteVar": {"name": name, "value": raw.hex(),
                              "op": "Append" if append else "Set", "when_version_is": None}}
        self._storage.append(entry)
        self._journal_storage.append(entry)

    def drain(self) -> tuple[str, list[dict]]:
        logs, storage = "".join(self._logs), self._storage
        self._logs, self._storage = [], []
        return logs, storage

    def journal(self) -> tuple[str, list[dict]]:
        """Everything logged and stored since the last call, whichever call produced it."""
        logs, self._journal_logs = self._journal_logs, []
        storage, self._journal_storage = self._journal_storage, []
        return "".join(logs), storage

    def forked(self) -> ControllerContext:
        """The context of a fork: same tokenizer and variables, its own logs."""
        return ControllerContext(self.tokenizer, self.variables, self.controllers)


class Controller:
    """Base class: plain generation (every token allowed, never stops on its own)."""

    def __init__(self, ctx: ControllerContext, arg: str, prompt: list[int]) -> None:
        self.ctx = ctx
        self.arg = arg
        self.prompt = list(prompt)

    def pre_process(self) -> PreResult:
        return PreResult()

    def mid_process(self) -> np.ndarray | None:
        """``None`` (no constraint) or a boolean array of allowed token ids (``vocab_size``
        long, or the tokenizer's length; ids past it are banned)."""
        return None

    def post_process(self, tokens: list[int], backtrack: int) -> bool:
        return False

    def fork(self, ctx: ControllerContext) -> Controller:
        """A copy for a new fork of this sequence, with the fork's context (``forked`` then
        tells each copy, and the original, which branch it is)."""
        memo: dict[int, Any] = {id(self.ctx): ctx, id(self.ctx.variables): ctx.variables,
                                id(self.ctx.tokenizer): ctx.tokenizer}
        return copy.deepcopy(self, memo)

    def forked(self, index: int) -> None:
        """This sequence is branch ``index`` of the fork its ``pre_process`` asked for (0: the
        original sequence, 1..n-1: the new ones, in order). Called before the next
        ``pre_process``, which every branch then runs."""
