"""Typed configuration of one served model (validated with msgspec)."""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from engines.kit.embedded import EMBEDDED_MODEL_NAME, local_model_dir
from engines.kit.kinds import check_engine_args, kind_of

__all__ = ["Autoscaling", "Controllers", "Lora", "ModelConfig", "Reasoning", "Routing",
           "Scheduling", "plain_adapter_name"]


class Controllers(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """AICI-style per-step controllers on a model (``docs/controllers.md``; kinds that run them:
    ``vllm`` and ``pipeline``): a controller runtime beside each replica and the engine hook
    that asks it every step.

    ``custom``: the operator's trusted controller classes, ``{tag: "package.module:Class"}``,
    beside the built-ins ``none`` and ``llguidance``. ``step_ms`` / ``init_ms``: the per-step and
    construction bounds of one controller (aicirt's defaults; a step call's bound is its own CPU
    time, within 4x that of wall time: ``engines.controllers.runtime.runtime.Limits``)."""

    custom: dict[str, str] = {}
    step_ms: float = 25.0
    init_ms: float = 1000.0

    def __post_init__(self) -> None:
        if not (self.step_ms > 0 and self.init_ms > 0):
            raise ValueError("controllers: step_ms and init_ms must be positive")
        for tag, path in self.custom.items():
            module, _, name = path.partition(":")
            if not tag or not module or not name:
                raise ValueError(f"controllers: custom {tag!r} must name 'package.module:Class'")


class Autoscaling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Serve's replica autoscaling for one model (``serve.config.AutoscalingConfig``, the
    options that matter for engines): replicas between ``min_replicas`` and ``max_replicas``,
    aiming at ``target_ongoing_requests`` per replica, averaged over ``look_back_period_s``;
    scale-up and scale-down wait for the load to last ``upscale_delay_s`` /
    ``downscale_delay_s``. No scale to zero: with no replica the gateway answers 503 at once
    (a model without a healthy replica is unavailable), which would never wake one up."""

    min_replicas: int = 1
    max_replicas: int = 2
    initial_replicas: int | None = None
    target_ongoing_requests: float = 4.0
    look_back_period_s: float = 30.0
    upscale_delay_s: float = 10.0
    downscale_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError("autoscaling needs 1 <= min_replicas <= max_replicas (no scale to "
                             "zero: a model without replicas is answered 503 at once)")
        if self.initial_replicas is not None and not (
                self.min_replicas <= self.initial_replicas <= self.max_replicas):
            raise ValueError("autoscaling initial_replicas must lie in [min, max]")
        if not self.target_ongoing_requests > 0:
            raise ValueError("autoscaling target_ongoing_requests must be positive")
        if self.upscale_delay_s < 0 or self.downscale_delay_s < 0:
            raise ValueError("autoscaling delays must be >= 0")
        if not self.look_back_period_s > 0:
            raise ValueError("autoscaling look_back_period_s must be positive")

    def serve_config(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not None}


class Scheduling(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How one replica orders its generations by priority (docs/tenancy.md, "Priority and
    fair share"; a key's tier sets a request's priority). ``max_running``: generations one
    replica runs in its engine at once; beyond, they wait in the replica, best priority first
    (``engines.replica.priority_gate``). None: all go to the engine, whose own queue orders them
    (vLLM's priority scheduling) once its batch is full. ``headroom``: of ``max_running``,
    the last this many slots go only to a request better than every one running, so a flood
    of a worse tier never makes a better one wait for a slot."""

    max_running: int | None = None
    headroom: int = 0

    def __post_init__(self) -> None:
        if self.max_running is not None and not 0 <= self.headroom < self.max_running:
            raise ValueError("scheduling: headroom must be at least 0 and below max_running")
        if self.max_running is None and self.headroom:
            raise ValueError("scheduling: headroom needs max_running")


class Reasoning(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A reasoning model's format (docs/reasoning.md). ``parser``: the name of the vLLM
    reasoning parser that reads it (``deepseek_r1`` and ``qwen3`` for ``<think>`` blocks,
    ``openai_gptoss`` for gpt-oss channels, every name vLLM registers; checked when the replica
    starts). ``budget_end``: the text forced when a request's reasoning budget is spent
    (default: the parser's end marker, e.g. ``</think>``). Budgets, and grammars that start
    after the reasoning, run as a controller: the model needs ``controllers`` on."""

    parser: str
    budget_end: str | None = None

    def __post_init__(self) -> None:
        if not self.parser.strip() or self.budget_end == "":
            raise ValueError("reasoning: parser must name a vLLM reasoning parser and "
                             "budget_end must not be empty")


class Routing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a request picks one of the model's replicas when it has more than one
    (docs/routing.md). ``prefix``: the replica most likely to hold the prompt's prefix in its KV
    cache (the one sent the longest part of it), unless that replica holds more than
    ``max_imbalance`` requests beyond the least-loaded one: then, and for a prompt no replica
    was sent, the least loaded. ``max_imbalance`` unset: an eighth of what a replica holds at
    once (``max_ongoing_requests``), at least 4 (vLLM's default: 32; a re-sent conversation's
    prefill costs more than a few more sequences in a batch). ``load``: Serve's own (power of
    two choices), blind to prefixes. ``memory_blocks``: prefix keys each router remembers (one
    per 128 characters of prompt; 65,536 cover 8M characters)."""

    policy: Literal["prefix", "load"] = "prefix"
    max_imbalance: int | None = None
    memory_blocks: int = 65536

    def __post_init__(self) -> None:
        if (self.max_imbalance is not None and self.max_imbalance < 0) or self.memory_blocks < 1:
            raise ValueError("routing: max_imbalance must be >= 0 and memory_blocks >= 1")


class Lora(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """LoRA adapters of a model (docs/adapters.md; kinds that serve them: ``vllm``). A request
    names one as its model (OpenAI, Responses, Anthropic, LMTP, AICI) or beside it (TGI's
    ``adapter_id``, SageMaker's adapter header, MindIE's ``adapter_id``).

    ``directory``: a folder whose subfolders are adapters in PEFT's layout, each named by its
    folder; read again when a request names an adapter not seen yet, so adapters copied or
    loaded there (``/v1/load_lora_adapter`` links them in) are served without a restart. On a
    cluster, a path every node reads (a shared mount). ``adapters``: more adapters by name,
    ``{name: directory}``. ``max_loaded``: adapters one replica runs at once (the rest wait
    for a slot, least recently used first out: vLLM's ``max_loras``); ``max_rank``: the
    largest rank served (a higher one is refused in the protocol's shape)."""

    directory: str | None = None
    adapters: dict[str, str] = {}
    max_loaded: int = 4
    max_rank: int = 16

    def __post_init__(self) -> None:
        if self.max_loaded < 1 or self.max_rank < 1:
            raise ValueError("lora: max_loaded and max_rank must be >= 1")
        for name, path in self.adapters.items():
            if not plain_adapter_name(name) or not path:
                raise ValueError(f"lora: adapter {name!r} needs a plain name (letters, digits, "
                                 "'._-') and a directory")


def plain_adapter_name(name: str) -> bool:
    """Whether ``name`` can name an adapter (and its folder): no separators, no dot names."""
    return bool(_ADAPTER_NAME.match(name)) and name not in (".", "..")


_ADAPTER_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model the gateway serves.

    ``engine``: the engine kind serving it (``engines.kit.kinds.ENGINE_KINDS``).
    ``source``: ``embedded:smollm2-135m-instruct`` or a local Hugging Face model directory.
    ``engine_args``: the kind's own options (``vllm``: ``AsyncEngineArgs`` on top of
    ``engines.vllm.args.DEFAULT_ENGINE_ARGS``; ``pipeline``: ``engines.pipeline.config.
    PipelineArgs``, checked here).
    ``num_replicas``: a fixed replica count, or ``autoscaling`` (``Autoscaling``) instead.
    ``resources``: custom Ray resources each replica needs, to place it on the nodes that
    offer them (``cluster.yaml``'s start commands give every node ``llm_gateway_cpu_engine`` or
    ``llm_gateway_gpu_engine``, and whatever ``LLM_GATEWAY_NODE_RESOURCES`` adds).
    ``num_cpus``: Ray CPUs reserved per replica; fractional so small boxes can schedule it
    (vLLM's own threads are bound by its CPU backend, not by this number).
    ``max_ongoing_requests``: requests one replica holds at once (default: twice the sequences
    the engine batches, ``EngineKind.concurrency_arg``, so the engine's own queue stays
    short). ``max_queued_requests``: requests each ingress replica queues for this model beyond
    that (default: as many as ongoing); more are refused as overloaded (429/503 in the
    protocol's shape) instead of waiting without bound. ``-1``: unbounded (Serve's default).
    ``colocated``: the engine runs inside each of the gateway's ingress replicas instead of in
    replicas of its own, so tokens reach the protocol encoders without a Ray hop (what Ray
    Serve LLM calls direct streaming); the ingress's replica count is then the model's, and
    ``num_cpus`` / ``num_gpus`` / ``resources`` are added to the ingress's own. At most one
    model per gateway, not with ``app``, ``num_replicas`` or ``autoscaling``.
    ``routing``: how requests pick a replica when there are several (``Routing``).
    ``lora``: the model's LoRA adapters (``Lora``; None: none).
    ``scheduling``: a replica's admission by priority (``Scheduling``).
    ``reasoning``: the model's reasoning format, when it thinks before answering
    (``Reasoning``; None: it does not).
    """

    name: str = EMBEDDED_MODEL_NAME
    engine: str = "vllm"
    source: str = f"embedded:{EMBEDDED_MODEL_NAME}"
    engine_args: dict[str, Any] = {}
    num_replicas: int = 1
    autoscaling: Autoscaling | None = None
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    resources: dict[str, float] = {}
    # Served by the Serve application of this name (``gateway.app:build_engine_app`` with this
    # entry as its args) rather than inside the gateway's application, so that changing the
    # gateway's model list does not restart this model's replicas (docs/cluster.md).
    app: str | None = None
    max_ongoing_requests: int | None = None
    max_queued_requests: int | None = None
    # How often Serve's controller health-checks each replica (Serve's default: 10 s). A dead
    # replica is noticed no sooner, and until then requests wait for it in Serve's router.
    health_check_period_s: float = 2.0
    colocated: bool = False
    # On by default for a kind that runs controllers (``EngineKind.runs_controllers``: vllm);
    # the hook costs nothing on steps without a controlled request. ``null`` turns the runtime
    # and the hook off; set on a kind that runs none, the config is refused.
    controllers: Controllers | msgspec.UnsetType | None = msgspec.UNSET
    routing: Routing = Routing()
    lora: Lora | None = None
    scheduling: Scheduling = Scheduling()
    reasoning: Reasoning | None = None

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("model name must not be empty")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        if self.app is not None and not self.app.strip():
            raise ValueError("app must name a Serve application")
        if self.colocated and (self.app is not None or self.num_replicas != 1
                               or self.autoscaling is not None):
            raise ValueError(f"model {self.name!r}: a colocated model runs in the gateway's "
                             "ingress replicas (ingress_replicas), so app, num_replicas and "
                             "autoscaling do not apply")
        if any(not v > 0 for v in self.resources.values()):
            raise ValueError("resources must be positive amounts")
        if self.max_ongoing_requests is not None and self.max_ongoing_requests < 1:
            raise ValueError("max_ongoing_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < -1:
            raise ValueError("max_queued_requests must be >= 0, or -1 for unbounded")
        if not self.health_check_period_s > 0:
            raise ValueError("health_check_period_s must be positive")
        kind = kind_of(self)  # a kind it names
        if self.lora is not None and not kind.serves_adapters:
            raise ValueError(f"model {self.name!r}: the {self.engine} engine serves no LoRA "
                             "adapters; leave `lora` out")
        if self.lora is not None and self.name in self.lora.adapters:
            raise ValueError(f"model {self.name!r}: an adapter cannot share its model's name")
        if self.controllers is msgspec.UNSET:
            msgspec.structs.force_setattr(
                self, "controllers", Controllers() if kind.runs_controllers else None)
        elif self.controllers is not None and not kind.runs_controllers:
            raise ValueError(f"model {self.name!r}: the {self.engine} engine runs no "
                             "controllers; leave `controllers` out")
        try:
            check_engine_args(self, local_model_dir(self.source))
        except ValueError as exc:
            raise ValueError(f"model {self.name!r}: {exc}") from None

    def ongoing_limit(self) -> int:
        if self.max_ongoing_requests is not None:
            return self.max_ongoing_requests
        kind = kind_of(self)
        return 2 * int(self.engine_args.get(kind.concurrency_arg) or kind.default_concurrency)

    def pending_limit(self) -> int | None:
        """Generations one ingress replica sends this model at most: what its replicas hold
        plus the queue (None: unbounded)."""
        if self.queue_limit() < 0:
            return None
        return self.ongoing_limit() * self.max_replicas() + self.queue_limit()

    def max_replicas(self) -> int:
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    def routes_by_prefix(self) -> bool:
        """Whether requests pick among several replicas by prefix (``Routing``)."""
        return self.routing.policy == "prefix" and self.max_replicas() > 1

    def routing_imbalance(self) -> int:
        """``Routing.max_imbalance``, or its default for this model's replicas."""
        if self.routing.max_imbalance is not None:
            return self.routing.max_imbalance
        return max(4, self.ongoing_limit() // 8)

    def replica_options(self) -> dict[str, Any]:
        """Serve's replica count options: a fixed count or the autoscaling config."""
        if self.autoscaling is None:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": self.autoscaling.serve_config()}

    def actor_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def queue_limit(self) -> int:
        if self.max_queued_requests is not None:
            return self.max_queued_requests
        return self.ongoing_limit()
