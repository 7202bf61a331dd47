"""What a LoRA adapter's directory holds, checked before an engine loads it (docs/adapters.md).

The gateway checks an adapter when it is linked in at runtime and each replica checks it once
before its engine loads it, so a folder that is not an adapter, or one of a rank over the
model's bound, is refused in the protocol's shape instead of failing inside the engine. The
messages name the adapter, never its path (clients see them).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import msgspec

from contract import AdapterInvalid

__all__ = ["ADAPTER_CONFIG", "AdapterFacts", "AdapterInvalid", "ModelShapes", "check_fits",
           "model_shapes", "read_adapter", "write_zero_adapter"]

ADAPTER_CONFIG = "adapter_config.json"
# PEFT writes one of these beside its config.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# An adapter's config is a few hundred bytes: a larger one is not PEFT's.
MAX_CONFIG_BYTES = 1 << 20


class AdapterFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What an adapter's config says: its rank and the base model it was trained on."""

    rank: int
    base_model: str | None = None


def read_adapter(name: str, path: str, max_rank: int) -> AdapterFacts:
    """``path``'s adapter facts; :class:`AdapterInvalid` unless it is a PEFT LoRA adapter of
    rank at most ``max_rank`` with its weights. Reads the small config file (blocking)."""
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise AdapterInvalid(f"adapter `{name}` has no {ADAPTER_CONFIG} (not a PEFT adapter)")
    if os.path.getsize(config_path) > MAX_CONFIG_BYTES:
        raise AdapterInvalid(f"adapter `{name}`: its {ADAPTER_CONFIG} is too large")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterInvalid(f"adapter `{name}`: its {ADAPTER_CONFIG} is not readable "
                             "JSON") from None
    if not isinstance(config, dict) or str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterInvalid(f"adapter `{name}` is not a LoRA adapter (peft_type "
                             f"{config.get('peft_type') if isinstance(config, dict) else None!r})")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterInvalid(f"adapter `{name}`: its rank `r` is not a positive integer")
    if rank > max_rank:
        raise AdapterInvalid(f"adapter `{name}` has rank {rank}, over this model's bound "
                             f"of {max_rank} (lora.max_rank)")
    if not any(os.path.isfile(os.path.join(path, w)) for w in WEIGHT_FILES):
        raise AdapterInvalid(f"adapter `{name}` has no weights ({' or '.join(WEIGHT_FILES)})")
    base = config.get("base_model_name_or_path")
    return AdapterFacts(rank=rank, base_model=base if isinstance(base, str) else None)


class ModelShapes(msgspec.Struct, frozen=True, kw_only=True):
    """The input and output widths of a decoder's projections (``module: (in, out)``), what an
    adapter's factors must fit, and its layer count."""

    layers: int
    modules: dict[str, tuple[int, int]]


def model_shapes(config: Any) -> ModelShapes | None:
    """A Hugging Face config's projection widths (Llama's names, which Qwen, Mistral, Gemma
    and most decoders share); None where the config says too little to tell."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    layers = getattr(config, "num_hidden_layers", None)
    if not (hidden and heads and layers):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head = getattr(config, "head_dim", None) or hidden // heads
    modules = {"q_proj": (hidden, heads * head), "k_proj": (hidden, kv * head),
               "v_proj": (hidden, kv * head), "o_proj": (heads * head, hidden)}
    inner = getattr(config, "intermediate_size", None)
    if inner:
        modules.update(gate_proj=(hidden, inner), up_proj=(hidden, inner),
                       down_proj=(inner, hidden))
    return ModelShapes(layers=int(layers), modules=modules)


# PEFT's names: "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight".
_FACTOR = re.compile(r"layers\.(\d+)\.(?:\w+\.)*?(\w+)\.lora_([AB])\.weight$")


def check_fits(name: str, path: str, shapes: ModelShapes) -> None:
    """:class:`AdapterInvalid` unless every factor of the adapter's safetensors fits the model
    (its layers exist, its widths are the model's): vLLM copies factors into its buffers
    inside a batch step, where a wider one fails the engine and a narrower one is garbage.
    Reads the file's header only. Weights in ``.bin`` are left to vLLM's loader."""
    weights = os.path.join(path, WEIGHT_FILES[0])
    if not os.path.isfile(weights):
        return
    from safetensors import safe_open

    try:
        with safe_open(weights, framework="np") as f:
            factors = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    except Exception:  # safetensors' own errors: a header that is not one
        raise AdapterInvalid(f"adapter `{name}`: its weights are not readable "
                             "safetensors") from None
    for key, shape in factors.items():
        match = _FACTOR.search(key)
        if match is None or match[2] not in shapes.modules or len(shape) != 2:
            continue  # vLLM's loader judges modules it does not know here
        layer, module, factor = int(match[1]), match[2], match[3]
        width_in, width_out = shapes.modules[module]
        wrong = layer >= shapes.layers or \
            (shape[1] != width_in if factor == "A" else shape[0] != width_out)
        if wrong:
            raise AdapterInvalid(f"adapter `{name}` does not fit this model (its {module} of "
                                 f"layer {layer} is {shape[0]}x{shape[1]}): trained for "
                                 "another base model?")


def write_zero_adapter(target: str, shapes: ModelShapes) -> str:
    """A rank-1 adapter whose factors are zero, in PEFT's layout in folder ``target``: it
    leaves the model as it is (vLLM zeroes the slot's other modules when it loads one).
    ``engines.vllm.adapters`` says what it is for."""
    import numpy as np
    from safetensors.numpy import save_file

    os.makedirs(target, exist_ok=True)
    width_in, width_out = shapes.modules["q_proj"]
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{prefix}.lora_A.weight": np.zeros((1, width_in), np.float32),
               f"{prefix}.lora_B.weight": np.zeros((width_out, 1), np.float32)},
              os.path.join(target, WEIGHT_FILES[0]))
    with open(os.path.join(target, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump({"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"],
                   "bias": "none"}, f)
    return target
