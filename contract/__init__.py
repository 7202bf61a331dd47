"""The engine contract: the one request/event model every protocol translates to and from, and
every engine kind produces (docs/engines.md). The bottom package: it imports nothing of the
gateway, the engines or the protocols, and all of them import it.

- :mod:`contract.requests`: what is asked (:class:`GenerateRequest`, prompts, sampling);
- :mod:`contract.events`: what an engine yields and the stream contract it follows;
- :mod:`contract.models`: what a model and its engine can do, and non-generate refusals;
- :mod:`contract.client`: what a protocol may ask of an engine (``EngineClient``) and of the
  model registry (``ModelDirectory``);
- :mod:`contract.pump`, :mod:`contract.tool_markup`, :mod:`contract.controller_tags`: the one
  stream pump, tool-call markup and controller tag rules both sides share.

The names of the first three are re-exported here: ``from contract import GenerateRequest``.
"""

from contract.events import (
    DEADLOCK,
    BacktrackEvent,
    ErrorEvent,
    ErrorKind,
    Event,
    FinalEvent,
    FinishReason,
    ForkEvent,
    PromptEvent,
    PromptToken,
    Timings,
    TokenEvent,
    TopLogprob,
    Usage,
    as_error,
    decode_events,
    encode_events,
    splice_allowed,
    splice_refusal,
)
from contract.models import (
    AdapterInvalid,
    AdapterNotFound,
    Capabilities,
    ControllerSupport,
    ControllerTag,
    EngineStats,
    EngineUnavailable,
    InvalidPrompt,
    ModelInfo,
    ModelNotFound,
    ModelRequired,
)
from contract.requests import (
    Adapter,
    ChatMessage,
    ChatPrompt,
    ControllerSpec,
    GenerateRequest,
    OutputOptions,
    Prompt,
    ReasoningOptions,
    Sampling,
    SpliceSupport,
    TextPrompt,
    TokenPrompt,
    ToolCall,
    ToolDefinition,
    reserved_template_kwargs,
)

__all__ = [
    "DEADLOCK", "Adapter", "AdapterInvalid", "AdapterNotFound", "BacktrackEvent", "Capabilities",
    "ChatMessage", "ChatPrompt", "ControllerSpec", "ControllerSupport", "ControllerTag",
    "EngineStats", "EngineUnavailable", "ErrorEvent", "ErrorKind", "Event", "FinalEvent",
    "FinishReason", "ForkEvent", "GenerateRequest", "InvalidPrompt", "ModelInfo", "ModelNotFound",
    "ModelRequired", "OutputOptions", "Prompt", "PromptEvent", "PromptToken", "ReasoningOptions",
    "Sampling", "SpliceSupport", "TextPrompt", "Timings", "TokenEvent",
    "TokenPrompt", "ToolCall", "ToolDefinition", "TopLogprob", "Usage", "as_error",
    "decode_events", "encode_events", "reserved_template_kwargs", "splice_allowed",
    "splice_refusal",
]
