"""The gateway's typed configuration: what ``serve run`` passes to ``build_app``."""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from engines.config import ModelConfig
from protocols.catalog import PROTOCOLS

__all__ = ["GatewayConfig", "load_config"]


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``models``: what to serve (default: the embedded SmolLM2). ``protocols``: which protocol
    packages to mount, in this order (``protocols.catalog``; default: all). ``api_key``: when
    set, every protocol route requires ``Authorization: Bearer <api_key>``. ``ingress_num_cpus``
    and ``ingress_replicas`` size the FastAPI ingress. The protocol options are documented where
    they are declared."""

    models: list[ModelConfig] = msgspec.field(default_factory=lambda: [ModelConfig()])
    protocols: list[str] = msgspec.field(default_factory=lambda: list(PROTOCOLS))
    api_key: str | None = None
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    max_ongoing_requests: int = 1024
    # Larger request bodies get a 413 in the protocol's shape (DJL's max_request_size default).
    max_request_bytes: int = 64 * 1024 * 1024
    # MindIE's fullTextEnabled: generate_stream events carry the cumulative text, not deltas.
    mindie_full_text: bool = False
    # Engine sequences one HTTP request may start (OpenAI prompt list times n, LMI dynamic-batch
    # inputs times n): a larger fan-out is refused in the protocol's shape before any engine work.
    max_fanout: int = 256
    # Extra names for served models, e.g. {"ensemble": "smollm2-135m-instruct"}.
    aliases: dict[str, str] = {}
    # LMI's option.tgi_compat: /invocations answers in TGI's shapes (a list; SSE streams).
    lmi_tgi_compat: bool = False
    # LMI's option.output_formatter for streams (an Accept header naming one wins).
    lmi_output_formatter: Literal["jsonlines", "sse"] = "jsonlines"
    # The model TGI's routes (/generate, /generate_stream, POST /, /info) serve; default: first.
    tgi_model: str | None = None

    def __post_init__(self) -> None:
        if self.max_fanout < 1:
            raise ValueError(f"max_fanout must be positive, got {self.max_fanout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        names = [m.name for m in self.models]
        if not names:
            raise ValueError("at least one model must be configured")
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        unknown = sorted(set(self.protocols) - set(PROTOCOLS))
        if unknown or not self.protocols or len(set(self.protocols)) != len(self.protocols):
            raise ValueError(f"protocols must be distinct names from {list(PROTOCOLS)}, got "
                             f"{self.protocols}")
        dangling = sorted(set(self.aliases.values()) - set(names))
        if dangling:
            raise ValueError(f"aliases point at models that are not served: {dangling}")
        if self.tgi_model is not None and self.tgi_model not in {*names, *self.aliases}:
            raise ValueError(f"tgi_model {self.tgi_model!r} is not a served model or alias")


def load_config(args: dict[str, Any] | GatewayConfig | None) -> GatewayConfig:
    """Validate the ``args`` mapping of a Serve config (or pass a ready config through)."""
    if isinstance(args, GatewayConfig):
        return args
    try:
        return msgspec.convert(args or {}, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid gateway config: {exc}") from None
