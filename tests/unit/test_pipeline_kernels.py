"""Linear weights packed for oneDNN on CPU (``engines/pipeline/kernels.py``): the same products
as torch's own linear, within the dtype's rounding; every projection replaced, the plain
weights freed; the head packed at the origin; only where asked for, on CPU, in a native dtype."""

from __future__ import annotations

import pytest
import torch

from engines.pipeline import kernels
from engines.pipeline.kernels import PackedLinear, pack_linears, packs
from engines.pipeline.loading import load_layers, load_origin
from tests.pipeline_models import build_tiny

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN: layers stay torch's own")

# Relative to the largest output: fp32 products of a few hundred terms differ in the order
# they are summed; bf16 ones in one rounding of the result at most.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _dtypes() -> list[torch.dtype]:
    return [d for d in (torch.float32, torch.bfloat16) if packs("packed", "cpu", d)]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_a_packed_linear_computes_what_torchs_does(dtype, rows):
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=generator).to(dtype)
    bias = torch.randn(96, generator=generator).to(dtype)
    x = torch.randn(2, rows, 64, generator=generator).to(dtype)  # [batch, tokens, hidden]
    for b in (bias, None):
        want = torch.nn.functional.linear(x, weight, b).float()
        got = PackedLinear(weight, b)(x)
        assert got.shape == (2, rows, 96) and got.dtype == dtype
        scale = want.abs().max()
        assert (got.float() - want).abs().max() <= TOLERANCE[dtype] * scale
    # A slice that is not contiguous (a packed micro-batch's part) is read as it is.
    part = x.transpose(0, 1)[:, :1]
    assert torch.allclose(PackedLinear(weight)(part).float(),
                          torch.nn.functional.linear(part, weight).float(),
                          rtol=0, atol=TOLERANCE[dtype] * float(scale))


def test_every_projection_of_a_stage_is_packed_and_the_stage_still_agrees(tiny_dir):
    layers = load_layers(tiny_dir, 1, 4)
    plain = load_layers(tiny_dir, 1, 4)
    count = sum(type(m) is torch.nn.Linear for m in layers.modules())
    assert pack_linears(layers) == count > 0
    assert not any(type(m) is torch.nn.Linear for m in layers.modules())
    assert not [name for name, _ in layers.named_parameters() if "proj" in name]  # freed
    hidden = torch.randn(1, 5, layers.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got = layers(inputs_embeds=hidden, position_ids=torch.arange(5)[None]).last_hidden_state
        want = plain(inputs_embeds=hidden, position_ids=torch.arange(5)[None]).last_hidden_state
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


@pytest.mark.parametrize("kind", ["llama", "llama-tied"])
def test_the_origin_packs_its_head_and_frees_a_head_of_its_own(kind, tmp_path):
    parts = load_origin(build_tiny(kind, tmp_path), 1)
    hidden = torch.randn(1, 3, parts.embed.weight.shape[1])
    with torch.inference_mode():
        want = parts.logits(hidden)
        vocab = parts.vocab_size
        tied = parts.head_weight is parts.embed.weight
        got = parts.pack().logits(hidden)
    assert got.dtype == torch.float32 and parts.vocab_size == vocab == got.shape[-1]
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()
    # A tied head keeps the embedding (the lookup needs it); a head of its own is only packed.
    assert tied == (kind == "llama-tied")
    assert (parts.head_weight is parts.embed.weight) if tied else parts.head_weight is None


def test_packing_is_for_cpu_in_a_native_dtype_and_only_when_asked(monkeypatch):
    assert packs("packed", "cpu", torch.float32)
    assert not packs("torch", "cpu", torch.float32)
    assert not packs("packed", "cuda", torch.float32)
    assert not packs("packed", "cpu", torch.float16)
    assert packs("packed", "cpu", torch.bfloat16) == (
        torch.ops.mkldnn._is_mkldnn_bf16_supported() and kernels._native_bf16())
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)  # oneDNN switched off
    assert not packs("packed", "cpu", torch.float32)
