"""vLLM engine arguments: the gateway's defaults and the machine-dependent dtype."""

from __future__ import annotations

from typing import Any

__all__ = ["CPU_KV_CACHE_BYTES", "DEFAULT_ENGINE_ARGS", "default_dtype", "engine_args"]

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


# On CPU, vLLM sizes the KV cache from gpu_memory_utilization times the NUMA node's RAM: half
# of a 24 GB box (12.3 GB RSS measured), and a second process of that size on the node had
# Ray's OOM killer take down the Serve controller, proxy, ingress and engine at once. A fixed
# size fits beside others: 2 GiB hold ~45k tokens of the embedded model in fp32 (30 layers x
# 2 x 3 KV heads x 64 x 4 B = 46 KB per token), 22 full 2048-token contexts.
CPU_KV_CACHE_BYTES = 2 * 1024**3


def engine_args(overrides: dict[str, Any]) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments: the defaults, ``overrides`` on top, ``dtype``
    resolved for this machine when unset, and on CPU an explicit KV cache size unless the
    overrides size it (``kv_cache_memory_bytes`` or ``gpu_memory_utilization``)."""
    args = {**DEFAULT_ENGINE_ARGS, **overrides}
    args.setdefault("dtype", default_dtype())
    sized = {"kv_cache_memory_bytes", "gpu_memory_utilization"} & set(overrides)
    if not sized and not _has_cuda():
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    return args


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()
