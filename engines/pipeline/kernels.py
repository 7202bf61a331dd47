"""Linear layers whose weights are reordered once, at load, for oneDNN's matmul on CPU
(docs/protocols/pipeline.md, "CPU kernels").

``torch.nn.functional.linear`` on CPU prepares the weight again on every call; for the few
rows a decode step has (one to a few dozen tokens per micro-batch) that is a large part of the
call. oneDNN's prepacked form (what torch's own compiler uses for CPU linears; vLLM's CPU
backend also prepares a oneDNN matmul per weight once) is made once: measured on the embedded
model's shapes, 1.3-1.7x faster
layer projections and 2-2.5x faster LM head at 8-16 rows (docs/benchmarks.md, "Packed
weights"). Only where oneDNN runs the dtype natively; elsewhere layers stay as they are.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

__all__ = ["CpuKernels", "PackedLinear", "pack_linears", "packs"]

CpuKernels = Literal["packed", "torch"]
# oneDNN picks the weight's layout for a typical row count; any count is computed correctly.
_ROWS_HINT = 8


def packs(kernels: CpuKernels, device: str, dtype: Any) -> bool:
    """Whether linear weights get packed: asked for, on CPU, in a dtype oneDNN runs natively
    (bfloat16 only on CPUs with its instructions)."""
    if kernels != "packed" or device != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.float32:
        return True
    return dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class PackedLinear(torch.nn.Module):
    """``y = x W^T + b`` with ``W`` in oneDNN's prepacked layout (the plain weight is not kept)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
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
