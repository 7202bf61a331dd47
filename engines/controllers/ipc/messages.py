"""The controller runtime's messages as types (``docs/protocols/controller-runtime.md``).

The wire stays the seed's JSON; these are what each end reads it as. The runtime decodes every
command it is sent with :func:`read` (a malformed one is the sender's error, in the runtime's
error shape); the engine's hook and frontend decode the runtime's answers (:class:`StepAnswer`,
:class:`AdvanceAnswer`) the same way, so no field is looked up by name at a call site.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from engines.kit.telemetry import Tally

__all__ = [
    "LOCAL", "Addressed", "Advance", "AdvanceAnswer", "Answer", "Auth", "BadMessage", "Failure",
    "FirstHalf", "Fork", "Forked", "GetStats", "GetTags", "Instantiate", "Journal", "MainCommand",
    "MidAnswer", "MidOp", "MidProcess", "MidRecord", "MkModule", "Ok", "Op", "Ping", "Pong",
    "PostOp", "PostPreProcess", "PostRecord", "PreOp", "PreRecord", "PreState", "Release",
    "Released", "Reply", "RowSpec", "RuntimeStats", "SetTags", "SideCommand", "Step",
    "StepAnswer", "Stopped", "TagInfo", "TagList", "Tokens", "Vocabulary", "read",
]

T = TypeVar("T")


class BadMessage(ValueError):
    """A command that does not have its op's shape."""


def read(data: Any, kind: type[T]) -> T:
    """``data`` (decoded JSON) as ``kind``, or :class:`BadMessage` saying what is wrong. A
    command union (:data:`MainCommand`, :data:`SideCommand`) is read by its ``op``: an op it
    does not have is named as unknown, and a malformed command by its op's type."""
    ops = _OPS.get(kind)
    op = data.get("op") if isinstance(data, dict) else None
    if ops is not None and isinstance(op, str) and op not in ops:
        raise BadMessage(f"unknown {_UNION_NAMES[kind]} op {op!r}; known: {', '.join(ops)}")
    try:
        return msgspec.convert(data, kind, strict=False)
    except msgspec.ValidationError as exc:
        name = ops[op].__name__ if ops is not None and op in ops else (
            _UNION_NAMES.get(kind) or kind.__name__)
        raise BadMessage(f"malformed {name} message: {exc}") from None


# --- envelopes ------------------------------------------------------------------------------

class Answer(msgspec.Struct, tag_field="type", kw_only=True):
    """Every answer is :class:`Ok` or :class:`Failure` (its ``type``); on the side channel it
    echoes the request's ``$rid`` (absent on the main channel, where answers keep order)."""

    rid: Any | UnsetType = msgspec.field(default=UNSET, name="$rid")


class Ok(Answer, tag="ok"):
    """The op's answer: one of the structs below, or (``get_tags``) a :class:`TagList`."""

    data: Any = None


class Failure(Answer, tag="error"):
    """The op failed: the sender's own error when ``is_user_error`` (a malformed command, an
    unknown controller), else the runtime's."""

    error: str = ""
    is_user_error: bool = False


Reply = Ok | Failure


class Auth(msgspec.Struct, frozen=True):
    """A side request's ``$auth``: who asks (tag names are per user; admins name any)."""

    user: str = ""
    is_admin: bool = False


LOCAL = Auth("localhost", is_admin=True)  # a request without ``$auth``: the engine's own


class Op(msgspec.Struct):
    """What every command has: its op (the server checks it before any handler reads more)."""

    op: str


class Addressed(msgspec.Struct):
    """A side request's ``$rid``, which its answer echoes (read first: a request malformed
    otherwise is still answered)."""

    rid: Any = msgspec.field(default=None, name="$rid")




class RowSpec(msgspec.Struct, frozen=True):
    """The frontend's binding of a vLLM request to a controller, in its sampling parameters:
    the engine sequence id ``seq`` runs the controller instantiated as ``req_id``."""

    seq: int
    req_id: str


# --- main channel: engine → runtime, one per step ------------------------------------------

class PreOp(msgspec.Struct):
    """Bind the engine's sequence ``id`` to the controller instantiated as ``req_id``."""

    id: int
    req_id: str


class PostOp(msgspec.Struct):
    """Tokens sequence ``id`` gained (after withdrawing ``backtrack``) since it was last told."""

    id: int
    tokens: list[int] | None = None
    backtrack: int | None = None


class MidOp(msgspec.Struct):
    """A row the engine may sample; ``clone_id``: the seed's fork, a copy of that sequence."""

    id: int
    clone_id: int | None = None


class _Main(msgspec.Struct, tag_field="op"):
    """A main-channel command, its type named by its ``op``."""


class Ping(_Main, tag="ping"):
    pass


class Tokens(_Main, tag="tokens"):
    """The vocabulary's size (answered with :class:`Vocabulary`)."""


class MidProcess(_Main, tag="mid_process"):
    """The seed's ``mid_process``: the rows to mask (its ``ops`` are mid ops)."""

    ops: list[MidOp] | None = None


class _Halves(_Main):
    post_ops: list[PostOp] | None = None
    pre_ops: list[PreOp] | None = None
    freed: list[int] | None = None


class PostPreProcess(_Halves, tag="post_pre_process"):
    """The seed's first half of a step: tokens gained, sequences bound and freed."""


class Step(_Halves, tag="step"):
    """Both halves of a step in one round trip (beyond the seed); ``mask_format: bits`` asks
    for bitmask rows."""

    mid_ops: list[MidOp] | None = None
    mask_format: Literal["floats", "bits"] | None = None


MainCommand = Ping | Tokens | MidProcess | PostPreProcess | Step


# --- side channel: frontend → runtime ------------------------------------------------------

class _Side(msgspec.Struct, tag_field="op", kw_only=True):
    """A side request, its type named by its ``op``: besides its op's fields, its ``$rid``
    (which the answer echoes) and who asks."""

    rid: Any = msgspec.field(default=None, name="$rid")
    auth: Auth | None = msgspec.field(default=None, name="$auth")


class Instantiate(_Side, tag="instantiate"):
    req_id: Any = None  # checked by the runtime, which says what a req_id must be
    module_id: Any = None
    module_arg: Any = None
    prompt: list[int] | str = []
    advance: bool = False  # answer with the first advance's state (AdvanceAnswer)


class Advance(_Side, tag="advance"):
    req_id: Any = None
    tokens: list[int] | None = None
    backtrack: int | None = None


class Fork(_Side, tag="fork"):
    req_id: Any = None
    into: list[str] = []


class Release(_Side, tag="release"):
    req_id: Any = None


class SetTags(_Side, tag="set_tags"):
    module_id: str | None = None
    tags: Any = None  # checked by contract.controller_tags, whose messages name the rule


class GetTags(_Side, tag="get_tags"):
    pass


class GetStats(_Side, tag="get_stats"):
    pass


class MkModule(_Side, tag="mk_module"):
    """The seed's Wasm upload: refused (this runtime has built-in controllers only)."""


SideCommand = Instantiate | Advance | Fork | Release | SetTags | GetTags | GetStats | MkModule


class TagInfo(msgspec.Struct, frozen=True):
    """The seed's ``TagInfo``: a tag naming a module (no Wasm here: its sizes are 0)."""

    tag: str
    module_id: str
    updated_at: int
    updated_by: str
    wasm_size: int = 0
    compiled_size: int = 0


class TagList(msgspec.Struct, frozen=True):
    """``get_tags`` / ``set_tags``'s answer."""

    tags: list[TagInfo]


# --- answers: runtime → engine and frontend ------------------------------------------------

class PreState(msgspec.Struct, frozen=True):
    """A pre_process result: the seed's three fields, and beyond the seed ``backtrack``, sent
    only when the controller withdraws tokens (read :attr:`withdrawn`)."""

    suspend: bool = False
    num_forks: int = 1
    ff_tokens: list[int] = []
    backtrack: int | UnsetType = UNSET

    @property
    def withdrawn(self) -> int:
        """Tokens to withdraw before ``ff_tokens`` (0 when none)."""
        return self.backtrack or 0

    @property
    def wants_edit(self) -> bool:
        """Whether it asks for what an engine cannot do in place: a fork, a suspend, forced
        or withdrawn tokens."""
        return bool(self.ff_tokens or self.backtrack or self.suspend or self.num_forks != 1)


class Stopped(msgspec.Struct, frozen=True):
    """A post_process result."""

    stop: bool = False


class _Record(msgspec.Struct, kw_only=True):
    """The seed's ``SequenceResult`` of one phase for one sequence: its error ("" when none),
    the logs and storage its controller wrote since, the microseconds its call ran."""

    error: str = ""
    storage: list[dict] = []
    logs: str = ""
    micros: int = 0


class PostRecord(_Record, kw_only=True):
    result: Stopped | None = None


class PreRecord(_Record, kw_only=True):
    result: PreState | None = None


class MidRecord(_Record, kw_only=True):
    result: None = None  # the mask is in the bias rows


class FirstHalf(msgspec.Struct):
    """``post_pre_process``'s answer."""

    post_seqs: dict[int, PostRecord] = {}
    pre_seqs: dict[int, PreRecord] = {}

    def ends(self) -> set[int]:
        """The sequences it ends in an engine that cannot edit in place: stopped, failed, or
        asking for an edit (:attr:`PreState.wants_edit`). The runtime leaves their rows out of
        the step's masks; the engine's hook ends them."""
        ended = {seq for seq, record in self.post_seqs.items()
                 if record.error or (record.result is not None and record.result.stop)}
        return ended | {seq for seq, record in self.pre_seqs.items()
                        if record.error or (record.result is not None
                                            and record.result.wants_edit)}


class MidAnswer(msgspec.Struct):
    """``mid_process``'s answer (the masks are in the bias rows)."""

    seqs: dict[int, MidRecord] = {}
    num_seqs: int = 0
    unmasked: list[int] = []  # rows left all-allowed, which an engine may skip
    ids: list[int] | UnsetType = UNSET  # ``step`` only: the sequence of each bias row


class StepAnswer(FirstHalf):
    """``step``'s answer: both halves in one."""

    mid: MidAnswer = msgspec.field(default_factory=MidAnswer)

    def ends(self) -> set[int]:
        """:meth:`FirstHalf.ends`, and the sequences whose mid_process failed."""
        return super().ends() | {seq for seq, record in self.mid.seqs.items() if record.error}


class Pong(msgspec.Struct):
    pong: int = 1


class Vocabulary(msgspec.Struct):
    """``tokens``' answer."""

    vocab_size: int


class Journal(msgspec.Struct, omit_defaults=True):
    """``instantiate``'s answer: what the controller logged and stored while built (an empty
    object when nothing)."""

    logs: str = ""
    storage: list[dict] = []


class Released(msgspec.Struct):
    released: bool


class Forked(msgspec.Struct):
    forks: list[str]


class AdvanceAnswer(msgspec.Struct):
    """A controller's state after ``advance`` (or ``instantiate`` with ``advance``): ``pre``
    is its pending pre result (None once stopped or failed); logs, storage and micros are
    those of every call since the previous advance."""

    stop: bool = False
    error: str = ""
    binds: int = 0  # segments the engine's hook bound it to
    pre: PreState | None = None
    logs: str = ""
    storage: list[dict] = []
    micros: int = 0


class RuntimeStats(msgspec.Struct):
    """``get_stats``' answer (beyond the seed): what the runtime counted since it started, for
    its replica to hand to Ray's metrics (the runtime's own process has no Ray). ``live`` is
    the controllers alive now: while any are, the replica keeps asking."""

    step: Tally  # every step's work, over engines.kit.telemetry.STEP_BUCKETS_S
    timeouts: dict[str, int]  # calls cut at their bound, by kind: "mid", "pre_post"
    live: int


def _ops(union: Any) -> dict[str, type]:
    return {member.__struct_config__.tag: member for member in union.__args__}


_OPS: dict[Any, dict[str, type]] = {MainCommand: _ops(MainCommand), SideCommand: _ops(SideCommand)}
_UNION_NAMES = {MainCommand: "main-channel", SideCommand: "side-channel"}
