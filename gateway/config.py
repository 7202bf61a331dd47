"""The gateway's typed configuration: what ``serve run`` passes to ``build_app``."""

from __future__ import annotations

import os
from typing import Any, Literal, TypeVar

import msgspec

from engines.kit.config import ModelConfig
from gateway.ingress.adapters import AdapterCatalog
from gateway.ingress.keys import ApiKey
from protocols.catalog import PROTOCOLS

Options = TypeVar("Options")

__all__ = ["GatewayConfig", "load_config"]


class GatewayConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``models``: what to serve (default: the embedded SmolLM2). ``protocols``: which protocol
    packages to mount, in this order (``protocols.catalog``; default: all). ``api_key``: when
    set, every protocol route requires ``Authorization: Bearer <api_key>`` (``api_keys``: several,
with rate limits). ``ingress_num_cpus``
    and ``ingress_replicas`` size the FastAPI ingress. The protocol options are documented where
    they are declared."""

    models: list[ModelConfig] = msgspec.field(default_factory=lambda: [ModelConfig()])
    protocols: list[str] = msgspec.field(default_factory=lambda: list(PROTOCOLS))
    api_key: str | None = None
    # Several keys, each with its own optional rate limits (gateway.ingress.keys.ApiKey); api_key, if
    # set, is one more key without limits.
    api_keys: list[ApiKey] = []
    # The key of the admin API (/gateway/admin/: keys made and deleted at runtime, every key's
    # usage; docs/tenancy.md). Not accepted on any other route.
    admin_key: str | None = None
    # Where the cluster's ledger (usage, budgets, admin-made keys) and the Batch API's files
    # live: a directory on the head node ("~" is its user's home).
    state_directory: str = "~/.local/state/llm-gateway"
    # The Batch API (docs/protocols/batches.md): the largest input file, the most requests in
    # one, and how many lines run at once (at the batch tier, below every key's).
    batch_max_file_mib: int = 32
    batch_max_lines: int = 50_000
    batch_concurrency: int = 8
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    # Serve's limit per ingress replica; keep it above max_concurrent_requests so the gateway,
    # not Serve's proxy (plain-text 503), answers the excess.
    max_ongoing_requests: int = 1024
    # HTTP requests and websocket connections one ingress replica works on at once; more get a
    # 503 with Retry-After in the protocol's shape before any work, so the replica's event loop
    # (and Serve's health check of it) never drowns.
    max_concurrent_requests: int = 512
    # Default deadline of a generation whose protocol did not set one (MindIE's `timeout` etc.
    # win); it ends with finish reason "abort"/"timeout". None: no default deadline.
    request_timeout_s: float | None = 600.0
    # A stream whose engine sends nothing for this long ends with an engine error (a replica
    # that is alive but stuck). None: no watchdog.
    engine_stall_timeout_s: float | None = 120.0
    # How engine replicas stream tokens to the ingress: "channel", one TCP connection per
    # (ingress replica, engine replica) carrying every stream's tokens of an engine step in one
    # frame (engines.channel; Ray only starts each generation); "ray", each stream's batches
    # as Ray objects (a Ray call per batch: a third of the speed on a fast engine). An engine
    # replica that cannot reach the ingress's address falls back to "ray" by itself.
    engine_transport: Literal["channel", "ray"] = "channel"
    # Model listings show the model's source (a filesystem path) as `root` / `modelUrl` only
    # when this is set; by default they show the model name.
    expose_model_paths: bool = False
    # LMTP bounds per websocket connection: concurrent streams, frame size (frames past
    # uvicorn's 16 MiB are closed by the HTTP server in front, the ingress replica's own under
    # HAProxy or Serve's proxy; docs/protocols/lmtp.md), and queued outgoing items
    # (a slow reader stalls its streams instead of growing memory); idle connections (no
    # stream, no frame) are closed after lmtp_idle_timeout_s.
    lmtp_max_streams: int = 128
    lmtp_max_frame_bytes: int = 4 * 1024 * 1024
    lmtp_outbox_items: int = 4096
    lmtp_idle_timeout_s: float | None = 900.0
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
    # Responses API: the most memory stored responses take, shared by the cluster's replicas
    # (the least recently used dropped first); 0 stores none (docs/protocols/responses.md).
    stored_responses_mib: int = 64

    @property
    def stored_responses_bytes(self) -> int:
        return self.stored_responses_mib * 1024 * 1024

    def __post_init__(self) -> None:
        for field in ("max_concurrent_requests", "max_ongoing_requests", "lmtp_max_streams",
                      "lmtp_max_frame_bytes", "lmtp_outbox_items", "batch_max_file_mib",
                      "batch_max_lines", "batch_concurrency"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        for field in ("request_timeout_s", "engine_stall_timeout_s", "lmtp_idle_timeout_s"):
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ValueError(f"{field} must be positive or null, got {value}")
        if self.stored_responses_mib < 0:
            raise ValueError(f"stored_responses_mib must be 0 or more, got "
                             f"{self.stored_responses_mib}")
        if self.max_fanout < 1:
            raise ValueError(f"max_fanout must be positive, got {self.max_fanout}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be positive, got {self.max_request_bytes}")
        secrets = [k.key for k in self.keys()] + ([self.admin_key] if self.admin_key else [])
        if len(set(secrets)) != len(secrets):
            raise ValueError("API keys (and the admin key) must be distinct")
        if self.admin_key is not None and not self.admin_key.strip():
            raise ValueError("admin_key must not be empty")
        names = [k.name for k in self.keys() if k.name]
        if len(set(names)) != len(names):
            raise ValueError(f"API key names must be distinct, got {names}")
        names = [m.name for m in self.models]
        if not names:
            raise ValueError("at least one model must be configured")
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique, got {names}")
        unknown = sorted(set(self.protocols) - set(PROTOCOLS))
        if unknown or not self.protocols or len(set(self.protocols)) != len(self.protocols):
            raise ValueError(f"protocols must be distinct names from {list(PROTOCOLS)}, got "
                             f"{self.protocols}")
        colocated = [m.name for m in self.models if m.colocated]
        if len(colocated) > 1:  # two engines in one process would fight over its cores / GPU
            raise ValueError(f"at most one model can be colocated with the ingress, got "
                             f"{colocated}")
        dangling = sorted(set(self.aliases.values()) - set(names))
        if dangling:
            raise ValueError(f"aliases point at models that are not served: {dangling}")
        if self.tgi_model is not None and self.tgi_model not in {*names, *self.aliases}:
            raise ValueError(f"tgi_model {self.tgi_model!r} is not a served model or alias")
        named = [a for m in self.models if m.lora is not None for a in m.lora.adapters]
        taken = sorted(({*names, *self.aliases} & set(named)) |
                       {a for a in named if named.count(a) > 1})
        if taken:  # a model's name resolves to the model: the adapter could not be reached
            raise ValueError(f"adapter names must differ from model names, aliases and each "
                             f"other: {taken}")

    def adapter_catalogs(self) -> dict[str, AdapterCatalog]:
        """Each model with LoRA adapters → its catalog (docs/adapters.md)."""
        return {m.name: AdapterCatalog(m.name, m.lora) for m in self.models if m.lora is not None}

    def ingress_actor_options(self) -> dict[str, Any]:
        """The ingress replica's Ray options: its own CPUs plus a colocated model's needs."""
        options: dict[str, Any] = {"num_cpus": self.ingress_num_cpus}
        for model in self.models:
            if model.colocated:
                engine = model.actor_options()
                options["num_cpus"] += engine.pop("num_cpus")
                options.update(engine)
        return options

    def options_for(self, kind: type[Options]) -> Options:
        """A protocol's options (``ProtocolSpec.options``) from this configuration: each of its
        fields reads the key its ``name`` gives (``lmtp_max_streams`` → ``max_streams``)."""
        return msgspec.convert(msgspec.to_builtins(self), kind)

    @property
    def tenancy(self) -> bool:
        """Whether callers are told apart (keys configured, or made through the admin API)."""
        return bool(self.keys()) or self.admin_key is not None

    @property
    def state_path(self) -> str:
        return os.path.expanduser(self.state_directory)

    def keys(self) -> list[ApiKey]:
        """Every accepted key (none: the gateway is open)."""
        return [*self.api_keys, *([ApiKey(key=self.api_key)] if self.api_key else [])]


def load_config(args: dict[str, Any] | GatewayConfig | None) -> GatewayConfig:
    """Validate the ``args`` mapping of a Serve config (or pass a ready config through)."""
    if isinstance(args, GatewayConfig):
        return args
    try:
        return msgspec.convert(args or {}, GatewayConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid gateway config: {exc}") from None
