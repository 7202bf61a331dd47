"""What a protocol asks an engine for: a prompt, decoding knobs, what to report, and the
optional controller, adapter and reasoning bounds (:class:`GenerateRequest`). Engine-neutral:
nothing here knows vLLM or a wire protocol."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from contract.base import Frozen as _Frozen
from contract.tool_markup import ToolCall, ToolDefinition

__all__ = ["Adapter", "ChatMessage", "ChatPrompt", "ControllerSpec", "GenerateRequest",
           "OutputOptions", "Prompt", "ReasoningOptions", "Sampling", "SpliceSupport",
           "TextPrompt", "TokenPrompt", "ToolCall", "ToolDefinition", "reserved_template_kwargs"]


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
    # Extra variables for the chat template (vLLM's ``chat_template_kwargs``), e.g. Qwen3's
    # ``enable_thinking``; a name the renderer sets itself is refused (reserved_template_kwargs).
    template_kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


# What the renderer passes to a chat template itself (or must not be swapped: the template).
_TEMPLATE_RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "tokenize", "chat_template", "return_dict", "tokenizer"})


def reserved_template_kwargs(template_kwargs: dict[str, Any]) -> list[str]:
    """The names in ``template_kwargs`` that the renderer sets itself (a request may not),
    sorted: the one check, made by a protocol (its own error) and by the renderer."""
    return sorted(_TEMPLATE_RESERVED.intersection(template_kwargs))


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
    logit_bias: dict[int, float] = {}  # noqa: RUF012 (msgspec copies a default per instance)
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
