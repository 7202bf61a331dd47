"""Typed configuration of one served model (validated with msgspec)."""

from __future__ import annotations

from typing import Any

import msgspec

from engines.embedded import EMBEDDED_MODEL_NAME

__all__ = ["DEFAULT_ENGINE_ARGS", "ModelConfig", "default_dtype"]

# Chosen for the 2-core / CPU case and harmless on a GPU: vLLM's CPU backend sizes its KV cache
# from gpu_memory_utilization against the NUMA node, and 0.92 fails on small nodes.
DEFAULT_ENGINE_ARGS: dict[str, Any] = {
    "max_model_len": 2048,
    "gpu_memory_utilization": 0.5,
    # MindIE/LMI send per-request priorities; vLLM rejects them unless this policy is on.
    "scheduling_policy": "priority",
    # Logprobs of the distribution actually sampled from (after logit_bias, penalties,
    # temperature). LMTP/LMQL needs log_softmax(logits + bias) for constrained decoding; for
    # plain greedy requests it is identical to vLLM's default raw logprobs.
    "logprobs_mode": "processed_logprobs",
}


def default_dtype() -> str:
    """``float32`` on x86 CPUs without native bf16 (AVX512-BF16), else vLLM's ``auto``.

    Measured on a 2-core AVX2 box with the embedded model: bf16 (emulated) gave 12.7 tok/s at 16
    streams, fp32 69.7 tok/s. GPUs and bf16-capable CPUs keep the checkpoint's dtype.
    """
    import platform

    import torch

    if torch.cuda.is_available() or platform.machine() not in ("x86_64", "AMD64"):
        return "auto"
    has_bf16 = getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    return "auto" if has_bf16 else "float32"


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One model the gateway serves.

    ``source``: ``embedded:smollm2-135m-instruct`` or a local Hugging Face model directory.
    ``engine_args``: passed to vLLM's ``AsyncEngineArgs`` on top of :data:`DEFAULT_ENGINE_ARGS`.
    ``num_cpus``: Ray CPUs reserved per replica; fractional so small boxes can schedule it
    (vLLM's own threads are bound by its CPU backend, not by this number).
    """

    name: str = EMBEDDED_MODEL_NAME
    source: str = f"embedded:{EMBEDDED_MODEL_NAME}"
    engine_args: dict[str, Any] = {}
    num_replicas: int = 1
    num_cpus: float = 0.5
    num_gpus: float = 0.0
    max_ongoing_requests: int = 256

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ValueError("model name must not be empty")
        if self.num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")

    def merged_engine_args(self) -> dict[str, Any]:
        """Engine args with defaults filled in (``dtype`` resolved for this machine)."""
        args = {**DEFAULT_ENGINE_ARGS, **self.engine_args}
        args.setdefault("dtype", default_dtype())
        return args
