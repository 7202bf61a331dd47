"""What a model is and what its engine can do (:class:`ModelInfo`, :class:`Capabilities`),
its replica's counts, and the refusals of non-generate calls, whose messages are safe to show a
client."""

from __future__ import annotations

from typing import Literal

from contract.base import Frozen as _Frozen
from contract.events import ErrorEvent

__all__ = ["AdapterInvalid", "AdapterNotFound", "Capabilities", "ControllerSupport",
           "ControllerTag", "EngineStats", "EngineUnavailable", "InvalidPrompt", "ModelInfo",
           "ModelNotFound", "ModelRequired"]


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
