"""Linear layers whose weights are reordered once, at load, for oneDNN's matmul on CPU
(docs/protocols/pipeline.md, "CPU kernels").

``torch.nn.functional.linear`` on CPU prepares the weight again on every call; for the few
rows a decode step has (one to a few dozen tokens per micro-batch) that is a large part of the
call. oneDNN's prepacked form (what torch's own compiler uses for CPU linears; vLLM's CPU
backend also prepares a oneDNN matmul per weight once) is made once. Measured on the embedded
model's shapes at 8-16 rows: layer projections 1.2-1.7x faster, the LM head 1.6-2.5x; at one
row about even (docs/results/benchmarks-2026-12-07.md, "Packed weights").

oneDNN builds a kernel for each weight shape and row count it meets (about 1 ms, once) and
keeps the last 1,024; a pipeline meets every row count up to ``max_batch_tokens`` for each of
a model's few weight shapes, so the first packed weight makes the cache larger.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from engines.pipeline.config import CpuKernels

__all__ = ["PackedLinear", "pack_linears", "packs"]

# oneDNN's kernel cache, read when it makes its first kernel in the process (measured: 1,200
# row counts of one shape all missed a second time with the default 1,024, all hit with this).
_KERNEL_CACHE = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "8192")
# oneDNN picks the weight's layout for a typical row count; any count is computed correctly.
_ROWS_HINT = 8


def _native_bf16() -> bool:
    """The CPU has bfloat16 instructions (oneDNN would emulate them on plain AVX-512)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            flags = next((line for line in cpuinfo if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def packs(kernels: CpuKernels, device: str, dtype: Any) -> bool:
    """Whether linear weights get packed: asked for, on CPU, with oneDNN available and on, in
    float32, or in bfloat16 on a CPU with bfloat16 instructions."""
    if kernels != "packed" or device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if not torch.backends.mkldnn.enabled:
        return False
    if dtype == torch.float32:
        return True
    return (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and _native_bf16())


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's prepacked layout (the plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        os.environ.setdefault(*_KERNEL_CACHE)  # before this process's first oneDNN kernel
        self.out_features, self.in_features = weight.shape
        self.dtype = weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _ROWS_HINT)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def pack_linears(model: torch.nn.Module) -> int:
    """Every ``nn.Linear`` inside ``model`` replaced by a :class:`PackedLinear` of its weights
    (which are then freed); returns how many."""
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child.weight, child.bias))
                replaced += 1
    return replaced
