"""The ``pipeline`` kind's options (a model entry's ``engine_args``), checked at config load.

No torch or Ray here: ``serve run`` validates a config without loading a model. Layer ranges are
checked against the checkpoint's ``num_hidden_layers`` whenever its ``config.json`` is readable
where the config is loaded, and again in the replica.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import msgspec

__all__ = ["SUPPORTED_MODEL_TYPES", "PipelineArgs", "check_engine_args", "check_model_type",
           "parse_args", "plan_stages"]

# Decoder families whose embedding is a plain lookup and whose head is a plain projection of the
# final norm, as the origin computes them. Others (Gemma's scaled embeddings and soft-capped
# logits, MoE per-expert checkpoints, quantised weights) would give wrong logits silently, so
# they are refused.
SUPPORTED_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})

Strategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]
CpuKernels = Literal["packed", "torch"]  # engines/pipeline/kernels.py


class PipelineArgs(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """``stages``: ``[start, end)`` layer ranges, one per stage actor, covering every layer
    after the origin's; unset → ``num_stages`` even ranges. ``origin_layers``: the first layers,
    kept in the replica so stages never see embedding rows (invertible to tokens).
    ``prefill_chunk``: prompt tokens of one sequence per micro-batch. ``max_batch_tokens``: tokens
    of all sequences per micro-batch. ``max_sequences``: sequences running at once, batched
    together (more wait in the replica). ``kv_cache_gib``: keys and values each stage (and the
    origin's own layers) may hold, all sequences together; a request reserves its prompt plus
    ``max_tokens`` (per choice) of it, waits while that does not fit, and is refused as
    overloaded when ``max_sequences`` requests already wait. ``max_restarts``: stage failures
    survived per request. ``digest``: blake2b per hop, checked on receipt. ``device``: where the
    origin and the stages compute (``cuda`` stages need ``stage_num_gpus``); activations cross
    the stage channel in host memory and stay on the device in-process.
    ``placement_strategy``: a placement group with one bundle per stage (``STRICT_SPREAD``: each
    stage on its own node);
    ``stage_resources``: custom resources per stage (from the cluster config), instead.
    ``cpu_kernels``: on CPU, ``packed`` reorders every linear weight once at load for oneDNN
    (faster small-batch matmuls; a head tied to the embedding then costs one more copy of it),
    ``torch`` keeps torch's plain layers (docs/protocols/pipeline.md, "CPU kernels")."""

    stages: list[tuple[int, int]] | None = None
    num_stages: int = 2
    origin_layers: int = 1
    prefill_chunk: int = 32
    max_batch_tokens: int = 256
    batches_in_flight: int | None = None  # None: one per stage
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    attn_implementation: Literal["sdpa", "eager"] = "sdpa"
    device: Literal["cpu", "cuda"] = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's, capped at 4096
    stage_num_cpus: float = 0.25
    stage_num_gpus: float = 0.0
    stage_threads: int | None = None  # torch threads per stage (Ray sets 1 for fractional CPUs)
    origin_threads: int | None = None
    placement_strategy: Strategy | None = None
    stage_resources: list[dict[str, float]] | None = None
    max_sequences: int = 16
    kv_cache_gib: float = 2.0
    max_restarts: int = 2
    digest: bool = False
    cache_ttl_s: float = 600.0
    step_timeout_s: float = 60.0  # per micro-batch in flight; a hung stage is respawned
    cpu_kernels: CpuKernels = "packed"

    def __post_init__(self) -> None:
        for name in ("num_stages", "prefill_chunk", "max_batch_tokens", "max_sequences"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.batches_in_flight is not None and self.batches_in_flight < 1:
            raise ValueError("batches_in_flight must be >= 1")
        for name in ("origin_layers", "max_restarts"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.step_timeout_s <= 0 or self.cache_ttl_s <= 0 or self.kv_cache_gib <= 0:
            raise ValueError("step_timeout_s, cache_ttl_s and kv_cache_gib must be > 0")
        if self.stage_num_cpus <= 0:
            raise ValueError("stage_num_cpus must be > 0 (Ray sizes a stage's threads by it)")
        if self.stage_resources is not None:
            if self.placement_strategy is not None:
                raise ValueError("give placement_strategy or stage_resources, not both")
            count = len(self.stages) if self.stages is not None else self.num_stages
            if len(self.stage_resources) != count:
                raise ValueError(f"stage_resources has {len(self.stage_resources)} entries for "
                                 f"{count} stages")
        if self.stages is not None:
            if not self.stages:
                raise ValueError("stages must name at least one layer range")
            self._check_ranges(None)

    def _check_ranges(self, num_layers: int | None) -> None:
        assert self.stages is not None
        expected = self.origin_layers
        for start, end in self.stages:
            if start < 0 or end <= start:
                raise ValueError(f"stage range [{start}, {end}) is empty or negative")
            if start != expected:
                what = "overlaps the previous one" if start < expected else "leaves a gap before it"
                raise ValueError(f"stage range [{start}, {end}) {what}: the next stage must start "
                                 f"at layer {expected} (origin_layers={self.origin_layers})")
            expected = end
        if num_layers is not None and expected != num_layers:
            what = "exceed" if expected > num_layers else "do not cover"
            raise ValueError(f"stage ranges end at layer {expected} and {what} the model's "
                             f"{num_layers} layers")


def parse_args(engine_args: dict[str, Any]) -> PipelineArgs:
    try:
        return msgspec.convert(engine_args, PipelineArgs)
    except msgspec.ValidationError as exc:
        raise ValueError(f"pipeline engine_args: {exc}") from None


def plan_stages(args: PipelineArgs, num_layers: int) -> list[tuple[int, int]]:
    """The stage ranges for a model with ``num_layers`` decoder layers."""
    if args.origin_layers >= num_layers:
        raise ValueError(f"origin_layers={args.origin_layers} leaves no layer of the model's "
                         f"{num_layers} for the stages")
    if args.stages is not None:
        args._check_ranges(num_layers)
        return [tuple(r) for r in args.stages]  # type: ignore[misc]
    layers = num_layers - args.origin_layers
    if args.num_stages > layers:
        raise ValueError(f"{args.num_stages} stages for {layers} layers")
    base, extra = divmod(layers, args.num_stages)
    ranges, start = [], args.origin_layers
    for i in range(args.num_stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def check_model_type(model_type: str | None) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"the pipeline engine does not support model type {model_type!r}; "
                         f"supported: {sorted(SUPPORTED_MODEL_TYPES)}")


def _text_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``config.json`` (multimodal wrappers: its ``text_config``); None when unreadable."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    config = json.loads(path.read_text())
    return config.get("text_config") or config


def check_engine_args(engine_args: dict[str, Any], local_dir: str | None) -> None:
    """What ``serve run`` refuses before any replica starts. The model itself is checked only
    when its directory is readable where the config is loaded (else in the replica)."""
    args = parse_args(engine_args)
    config = _text_config(local_dir) if local_dir else None
    if config is not None:
        check_model_type(config.get("model_type"))
        layers = config.get("num_hidden_layers")
        if isinstance(layers, int):
            plan_stages(args, layers)
