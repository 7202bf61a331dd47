"""The one internal request/event model every protocol translates to and from.

Protocols decode their wire format into a :class:`GenerateRequest`, hand it to an
``EngineClient`` (``protocols/contract.py``), and encode the :data:`Event` stream it yields back
to their wire format. Nothing here knows about vLLM or any wire protocol.

Stream contract (what every engine yields for one request):

1. at most one :class:`PromptEvent` first, when prompt token ids or prompt logprobs were asked
   for (``OutputOptions.prompt_logprobs`` / ``echo``);
2. per choice ``index``, in order: :class:`TokenEvent` s, one per token appended to the choice
   (``forced`` when a controller appended it without sampling: fast-forward), and, only as far
   as the request's ``OutputOptions.splices`` allows, :class:`BacktrackEvent` s (the choice's
   last tokens are withdrawn; ``"retract"`` and ``"full"``) and :class:`ForkEvent` s (a new
   choice starts as a copy of this one, before any event of the new index; ``"full"``). A splice
   the request does not allow ends the stream with the :class:`ErrorEvent` of
   :func:`splice_refusal` instead (the engine host enforces this for every engine kind);
3. exactly one :class:`FinalEvent` per choice; the stream ends after the last choice's. A
   :class:`TokenEvent` with ``last`` set is its choice's last event before the FinalEvent;
4. or, instead of (2)/(3) or after some of them, one :class:`ErrorEvent`, which ends the stream.

Refusals are events, never exceptions: a request the engine cannot serve yields one
:class:`ErrorEvent` first, so every protocol can answer with its own status and shape.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from protocols.tool_markup import ToolCall, ToolDefinition

__all__ = [
    "Adapter", "AdapterInvalid", "AdapterNotFound", "BacktrackEvent", "Capabilities", "ChatMessage",
    "ChatPrompt",
    "ControllerSpec", "ControllerTag", "DEADLOCK", "ControllerSupport", "EngineStats", "ErrorEvent",
    "EngineUnavailable", "ErrorKind", "Event", "FinalEvent", "FinishReason", "ForkEvent",
    "GenerateRequest", "InvalidPrompt", "ModelInfo", "ModelNotFound", "ModelRequired",
    "OutputOptions", "Prompt", "PromptEvent", "PromptToken", "ReasoningOptions", "Sampling",
    "SpliceSupport",
    "TextPrompt", "Timings", "TokenEvent", "TokenPrompt", "ToolCall", "ToolDefinition",
    "TopLogprob", "Usage", "as_error", "decode_events", "encode_events", "splice_allowed",
    "splice_refusal",
]


class _Frozen(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


# --- prompts ------------------------------------------------------------------------------


class TextPrompt(_Frozen, tag="text", kw_only=True):
    """Plain text; the engine tokenizes it (adding special tokens as the model expects)."""

    text: str
    add_special_tokens: bool = True


class ChatMessage(_Frozen, kw_only=True):
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None  # a tool message: the function that answered


class ChatPrompt(_Frozen, tag="chat", kw_only=True):
    """Chat messages; the engine renders them with the model's chat template, with ``tools``
    offered to the model (in the template's own way, or as docs/protocols/tools.md says)."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: tuple[ToolDefinition, ...] = ()


class TokenPrompt(_Frozen, tag="tokens", kw_only=True):
    """Token ids used as they are: no BOS added, no tokenizer involved (LMTP, SCORE)."""

    token_ids: tuple[int, ...]


Prompt = TextPrompt | ChatPrompt | TokenPrompt


# --- request ------------------------------------------------------------------------------


class Sampling(_Frozen, kw_only=True):
    """Decoding knobs, in engine-neutral form. ``temperature == 0`` means greedy.

    ``top_k == 0`` and ``top_p == 1`` mean off. ``logit_bias`` is applied at every step.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    typical_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context limit
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logit_bias: dict[int, float] = {}
    n: int = 1
    best_of: int | None = None


# What a consumer can render besides appended tokens: "append" (nothing else: streams that can't
# take text back), "retract" (backtracks too), "full" (backtracks and forks: new choices).
SpliceSupport = Literal["append", "retract", "full"]


class OutputOptions(_Frozen, kw_only=True):
    """What the protocol wants reported besides the text."""

    logprobs: int | None = None  # None: no logprobs; k: sampled token plus top-k alternatives
    prompt_logprobs: int | None = None  # None: none; k: per prompt position, plus top-k
    echo: bool = False  # return the prompt (ids and text) in a PromptEvent
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    token_pieces: bool = False  # fill TokenEvent.piece (protocols that report text per token)
    splices: SpliceSupport = "append"  # what the protocol can render (module docstring, rule 2)


class ControllerSpec(_Frozen, kw_only=True):
    """An AICI-style controller attached to the request (``docs/protocols/aici.md``,
    ``docs/controllers.md``)."""

    module: str
    arg: str = ""


class Adapter(_Frozen, kw_only=True):
    """A LoRA adapter of the model that runs the request (docs/adapters.md): its name and
    its directory (PEFT's layout), resolved by the gateway so a replica needs no catalog.
    ``version`` changes when the name is linked to a folder anew (a replica then loads it
    again, not the weights it holds under that name)."""

    name: str
    path: str
    version: int = 0


class ReasoningOptions(_Frozen, kw_only=True):
    """How a reasoning model may think (docs/reasoning.md). ``max_tokens``: the most tokens
    its reasoning may take; when they are spent the engine appends the model's end-of-reasoning
    marker and the answer begins (None: no bound but the request's own ``max_tokens``)."""

    max_tokens: int | None = None


class GenerateRequest(_Frozen, kw_only=True):
    request_id: str
    model: str
    prompt: Prompt
    sampling: Sampling = Sampling()
    output: OutputOptions = OutputOptions()
    priority: int = 0  # lower runs first (vLLM and MindIE agree on the direction)
    timeout_s: float | None = None  # deadline, measured from when the engine receives the request
    controller: ControllerSpec | None = None
    adapter: Adapter | None = None  # None: the base model
    # Bounds on a reasoning model's thinking; ignored by a model that does not reason.
    reasoning: ReasoningOptions | None = None


# --- events -------------------------------------------------------------------------------

FinishReason = Literal["eos", "stop_sequence", "length", "abort", "error"]
# overloaded: the service is full, retry later; rate_limited: the caller's own limit (its key's
# token budget); unavailable: no healthy engine replica now; engine: the engine failed it.
ErrorKind = Literal["validation", "not_found", "overloaded", "rate_limited", "unavailable", "engine"]


class TopLogprob(_Frozen, kw_only=True):
    token_id: int
    text: str
    logprob: float


class PromptToken(_Frozen, kw_only=True):
    token_id: int
    text: str
    logprob: float | None = None  # None for the first position (no context)
    top_logprobs: tuple[TopLogprob, ...] = ()
    # This token's rank among the model's candidates at its position (1 = the most likely);
    # None where ``logprob`` is, or where an engine does not rank.
    rank: int | None = None


class PromptEvent(_Frozen, tag="prompt", kw_only=True):
    """The prompt as the engine saw it: ids, text and (if asked) per-position logprobs."""

    text: str
    tokens: tuple[PromptToken, ...]


class TokenEvent(_Frozen, tag="token", kw_only=True):
    """One generated token. ``text`` is the text delta it completes (may be empty while the
    detokenizer holds back an incomplete character or a possible stop string)."""

    index: int = 0
    token_id: int
    text: str
    # A reasoning model's thinking (docs/reasoning.md): the part of this token's text delta
    # that is reasoning. ``text`` is then the answer's part only, so a protocol that shows no
    # reasoning renders ``text`` alone; the markers around the reasoning are in neither.
    reasoning: str = ""
    logprob: float | None = None
    top_logprobs: tuple[TopLogprob, ...] = ()
    special: bool = False
    token_text: str | None = None  # this token's own text, when logprobs were requested
    # With ``OutputOptions.token_pieces``: the text this token adds by plain incremental
    # detokenization ("" while a character is incomplete). ``text`` can't serve there: it lags
    # behind the tokens while a stop string may be forming, and when vLLM merges the deltas of
    # several steps (a busy consumer) the whole text lands on the last token.
    piece: str | None = None
    last: bool = False  # the choice's FinalEvent follows immediately (no more tokens come)
    forced: bool = False  # appended by a controller without sampling (fast-forward); no logprob
    # Engine-side measurements, for protocols that report per-token timing (MindIE):
    elapsed_s: float = 0.0  # since the engine received the request, when this token was produced
    batch_size: int = 0  # requests in flight in this engine replica at that moment
    queue_s: float | None = None  # on a choice's first token: admitted → first scheduled
    # A controlled choice: what its controller logged, the variables it wrote and the
    # microseconds it ran since the previous event that carried them (AICI streams them with
    # each event); the rest comes with the FinalEvent.
    logs: str = ""
    storage: tuple[dict[str, Any], ...] = ()
    micros: int = 0


class BacktrackEvent(_Frozen, tag="backtrack", kw_only=True):
    """The last ``count`` tokens of choice ``index`` are withdrawn; ``text`` is the text their
    TokenEvents had added, so consumers that keep text can cut exactly that much."""

    index: int = 0
    count: int
    text: str = ""


class ForkEvent(_Frozen, tag="fork", kw_only=True):
    """Choice ``index`` is new and starts as a copy of choice ``parent`` as it stands now (its
    tokens and text); events of either choice follow independently."""

    index: int
    parent: int = 0


class Usage(_Frozen, kw_only=True):
    """Per choice. ``completion_tokens``: tokens in the choice's output as finally returned
    (after backtracks; a fork counts what it inherited). ``forced_tokens``: tokens appended to
    it without sampling; ``sampled_tokens``: tokens its sampler drew, retracted ones included
    (``None``: no splices happened, so ``completion_tokens - forced_tokens``)."""

    prompt_tokens: int
    completion_tokens: int
    forced_tokens: int = 0
    sampled_tokens: int | None = None
    # Prompt tokens the engine took from its prefix cache (a controlled run: summed over the
    # resubmissions its edits cost).
    cached_tokens: int = 0
    # Of ``completion_tokens``, those of a reasoning model's thinking, its end marker included.
    reasoning_tokens: int = 0

    @property
    def sampled(self) -> int:
        if self.sampled_tokens is not None:
            return self.sampled_tokens
        return self.completion_tokens - self.forced_tokens


class Timings(_Frozen, kw_only=True):
    """Seconds. ``queue_s``: admitted → scheduled; ``ttft_s``: arrival → first token;
    ``decode_s``: first → last token."""

    queue_s: float = 0.0
    ttft_s: float = 0.0
    decode_s: float = 0.0


class FinalEvent(_Frozen, tag="final", kw_only=True):
    index: int = 0
    finish_reason: FinishReason
    stop_reason: str | int | None = None  # matched stop string or stop token id
    usage: Usage
    timings: Timings = Timings()
    text: str = ""  # trailing text flushed at the end (held-back bytes); usually empty
    reasoning: str = ""  # the reasoning part of that trailing text (TokenEvent.reasoning)
    # What the choice's controller logged, the variables it wrote (AICI's ``storage``
    # entries, ``{"WriteVar": {"name", "value": <hex>, "op", "when_version_is"}}``) and the
    # microseconds it ran, since its last TokenEvent that carried them.
    logs: str = ""
    storage: tuple[dict[str, Any], ...] = ()
    micros: int = 0


class ErrorEvent(_Frozen, tag="error", kw_only=True):
    kind: ErrorKind
    message: str
    param: str | None = None


# ErrorEvent.param of a controlled run whose branches are all suspended (AICI's "deadlock")
DEADLOCK = "deadlock"


Event = PromptEvent | TokenEvent | BacktrackEvent | ForkEvent | FinalEvent | ErrorEvent


def splice_allowed(event: BacktrackEvent | ForkEvent, support: SpliceSupport) -> bool:
    if isinstance(event, BacktrackEvent):
        return support != "append"
    return support == "full"


def as_error(event: ErrorEvent | BacktrackEvent | ForkEvent) -> ErrorEvent:
    """What ends a stream that can only grow: an error, or a splice it cannot show."""
    return event if isinstance(event, ErrorEvent) else splice_refusal(event)


def splice_refusal(event: BacktrackEvent | ForkEvent) -> ErrorEvent:
    """The error that ends a stream whose consumer cannot render ``event``."""
    what = "withdrew tokens" if isinstance(event, BacktrackEvent) else "forked into a new choice"
    return ErrorEvent(kind="validation", param="controller", message=f"the controller {what}, "
                      "which this response cannot show; send the request without streaming")


# --- models and what their engines can do ---------------------------------------------------

ControllerSupport = Literal["none", "mask", "splice"]


class Capabilities(_Frozen, kw_only=True):
    """What an engine kind can serve; admission refuses anything beyond it, for every protocol.

    ``controllers``: "none", "mask" (per-step logit masks only) or "splice" (masks plus
    fast-forward, backtrack and fork). ``max_logprobs`` / ``max_prompt_logprobs``: the most
    alternatives per position (``None``: not reported at all). ``best_of_above_n``: whether
    extra candidates can be drawn and ranked (vLLM v1 cannot). ``adapters``: whether requests
    may name a LoRA adapter (``GenerateRequest.adapter``; docs/adapters.md).
    """

    controllers: ControllerSupport = "none"
    max_logprobs: int | None = 20
    max_prompt_logprobs: int | None = 20
    max_n: int = 128
    best_of_above_n: bool = False
    priority: bool = True
    adapters: bool = False


class ControllerTag(_Frozen, kw_only=True):
    """A controller an engine hosts: the tag requests name it by, and its module id (sha256
    hex, as AICI's Wasm module ids; requests may name either)."""

    tag: str
    module_id: str


class ModelInfo(_Frozen, kw_only=True):
    name: str
    root: str  # the underlying model path or id
    max_model_len: int
    vocab_size: int
    eos_token_id: int | None = None
    engine: str = "vllm"  # the engine kind serving it (ModelConfig.engine)
    dtype: str = "float32"  # what the engine computes in; numeric tolerances follow it
    capabilities: Capabilities = Capabilities()
    controllers: tuple[ControllerTag, ...] = ()  # with capabilities.controllers != "none"
    # The most characters a text or chat prompt can have and still fit max_model_len tokens:
    # admission refuses a longer one before tokenizing it. None: no bound (every prompt is
    # tokenized, then its tokens are counted).
    max_prompt_chars: int | None = None
    # The model's reasoning format (a vLLM reasoning parser's name, docs/reasoning.md): its
    # events carry their thinking apart (TokenEvent.reasoning). None: the model does not reason.
    reasoning: str | None = None


class EngineStats(_Frozen, kw_only=True):
    """Requests in flight in one engine replica, how many were cancelled before finishing
    (client disconnects), and how many it started since it started."""

    active: int = 0
    aborted: int = 0
    started: int = 0


class ModelNotFound(LookupError):
    def __init__(self, name: str):
        super().__init__(f"The model `{name}` does not exist.")
        self.name = name


class AdapterNotFound(ModelNotFound):
    """An adapter named beside its base model (TGI's ``adapter_id``, SageMaker's adapter
    header) that the model does not serve."""

    def __init__(self, model: str, adapter: str):
        LookupError.__init__(self, f"The model `{model}` has no adapter `{adapter}`.")
        self.name = adapter


class AdapterInvalid(ValueError):
    """A LoRA adapter that cannot be served or loaded (not PEFT's layout, its rank over the
    model's bound, its weights for another model, a name taken); the message is safe to show
    a client. Protocols answer 400 in their own shape."""


class ModelRequired(LookupError):
    def __init__(self) -> None:
        super().__init__("`model` is required when the gateway serves more than one model.")


class InvalidPrompt(ValueError):
    """A non-generate engine call (tokenize) refused its prompt; the message is safe to show a
    client. Protocols answer 400 in their own shape (``generate`` reports the same refusal as
    a validation :class:`ErrorEvent`)."""


class EngineUnavailable(RuntimeError):
    """A non-generate engine call (tokenize, model info, ...) could not be answered: no healthy
    replica, or it failed. The message is safe to show a client (no addresses, no traces);
    protocols answer 503 in their own shape."""

    def __init__(self, model: str, what: str = "the engine is unavailable"):
        super().__init__(f"model `{model}`: {what}; retry later")
        self.model = model

    def event(self) -> ErrorEvent:
        return ErrorEvent(kind="unavailable", message=str(self))


# --- wire codec between processes (engine replica ↔ ingress) -------------------------------

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[Event])


def encode_events(events: list[Event]) -> bytes:
    """Pack a batch of events for crossing a process boundary (much cheaper than pickle)."""
    return _encoder.encode(events)


def decode_events(data: bytes) -> list[Event]:
    return _decoder.decode(data)
