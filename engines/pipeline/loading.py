"""Build a slice of an HF decoder-only model from its checkpoint, reading only that slice.

The sliced-config approach (``docs/protocols/pipeline.md``, "Sliced configuration"): a copy of
the text config with ``num_hidden_layers = end - start`` (and ``layer_types[start:end]``)
builds the base model on the ``meta`` device; only the tensors of layers ``[start, end)`` are
read from the safetensors files and renamed to local indices. The model's own forward then
builds masks, rotary embeddings and per-layer-type caches correctly, and a stage's cache is
compact (its layer 0 is ``start``).
No Ray here, so the same code runs in stage actors, the origin, tests and on a bare GPU box.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

__all__ = ["OriginParts", "load_config", "load_layers", "load_origin", "read_tensors",
           "sliced_config", "text_config"]

# Prefixes under which checkpoints keep the decoder's tensors: plain causal LMs, and the text
# tower of multimodal wrappers.
_PREFIXES = ("model.", "model.language_model.", "language_model.model.")


def load_config(model_dir: str | Path) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


def text_config(config: Any) -> Any:
    return getattr(config, "text_config", None) or config


def sliced_config(config: Any, start: int, end: int, attn_implementation: str) -> Any:
    """A copy of the text config describing only layers ``[start, end)``."""
    cfg = copy.deepcopy(text_config(config))
    layer_types = getattr(cfg, "layer_types", None)
    cfg.num_hidden_layers = end - start
    if layer_types is not None:
        cfg.layer_types = list(layer_types[start:end])
    # Set explicitly: modules built outside from_pretrained don't resolve it
    # (docs/protocols/pipeline.md, "Sliced configuration").
    cfg._attn_implementation = attn_implementation
    return cfg


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: model_dir / file for name, file in weight_map.items()}
    single = model_dir / "model.safetensors"
    if not single.is_file():
        raise FileNotFoundError(f"{model_dir} has no model.safetensors(.index.json)")
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def read_tensors(model_dir: str | Path, wanted) -> dict[str, Any]:
    """The tensors whose names satisfy ``wanted(name)``, opening only the files holding them."""
    from safetensors import safe_open

    by_file: dict[Path, list[str]] = {}
    for name, file in _weight_files(Path(model_dir)).items():
        if wanted(name):
            by_file.setdefault(file, []).append(name)
    tensors = {}
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as f:
            for name in names:
                tensors[name] = f.get_tensor(name)
    return tensors


def _prefix(names) -> str:
    for prefix in _PREFIXES[::-1]:  # the longest first
        if any(n.startswith(prefix + "layers.") or n.startswith(prefix + "embed_tokens.")
               for n in names):
            return prefix
    raise ValueError("checkpoint has no decoder layers under a known prefix "
                     f"({', '.join(p + 'layers.' for p in _PREFIXES)})")


def _build(cfg: Any, state: dict[str, Any], dtype, keep_embed: bool, keep_norm: bool):
    """The base model for ``cfg`` with ``state`` assigned; everything else stays off."""
    import torch
    from transformers import AutoModel

    with torch.device("meta"):
        model = AutoModel.from_config(cfg, dtype=dtype)
    if not keep_embed:
        model.embed_tokens = None
    if not keep_norm:
        model.norm = torch.nn.Identity()
    state = {k: v.to(dtype) for k, v in state.items()}
    result = model.load_state_dict(state, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"unexpected tensors for this slice: {result.unexpected_keys[:5]}")
    missing = [k for k in result.missing_keys if "rotary" not in k]
    if missing:  # strict=False must not leave real weights uninitialised (docs/protocols/pipeline.md)
        raise ValueError(f"checkpoint lacks tensors for this slice: {missing[:5]}")
    # Non-persistent buffers (rotary inv_freq) stay on meta after assign=True: rebuild them.
    if hasattr(model, "rotary_emb"):
        model.rotary_emb = type(model.rotary_emb)(config=cfg)
    return model.eval()


def load_layers(model_dir: str | Path, start: int, end: int, dtype=None,
                attn_implementation: str = "sdpa", config: Any = None):
    """The decoder layers ``[start, end)`` as a base model with no embedding and no final norm:
    call it with ``inputs_embeds``, ``position_ids`` and a ``DynamicCache(config=model.config)``
    (a stage runs them through ``packed.run_layers`` instead, over its ``KVPool``)."""
    import torch

    config = config or load_config(model_dir)
    num_layers = text_config(config).num_hidden_layers
    if not 0 <= start < end <= num_layers:
        raise ValueError(f"layer range [{start}, {end}) is outside the model's {num_layers} layers")
    names = list(_weight_files(Path(model_dir)))
    prefix = _prefix(names)
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.+)")

    def wanted(name: str) -> bool:
        m = pattern.fullmatch(name)
        return m is not None and start <= int(m.group(1)) < end

    state = {}
    for name, tensor in read_tensors(model_dir, wanted).items():
        m = pattern.fullmatch(name)
        assert m is not None
        state[f"layers.{int(m.group(1)) - start}.{m.group(2)}"] = tensor
    cfg = sliced_config(config, start, end, attn_implementation)
    return _build(cfg, state, dtype or torch.float32, keep_embed=False, keep_norm=False)


class OriginParts:
    """What the origin owns: the embedding, the final norm, the LM head (the embedding matrix
    when tied) and the first ``origin_layers`` decoder layers (``layers``, None when 0)."""

    def __init__(self, embed, norm, head_weight, layers):
        self.embed = embed
        self.norm = norm
        self.head_weight = head_weight
        self.layers = layers
        self.head = None  # a PackedLinear of the head's weight, once packed
        self.vocab_size = int(head_weight.shape[0])

    def pack(self) -> OriginParts:
        """The head's and the own layers' weights packed for oneDNN (``engines.pipeline.kernels``).
        A head of its own is then only packed; one tied to the embedding keeps the embedding's
        weight too (one more copy of it)."""
        from engines.pipeline.kernels import PackedLinear, pack_linears

        self.head = PackedLinear(self.head_weight)
        if self.head_weight is not self.embed.weight:
            self.head_weight = None
        if self.layers is not None:
            pack_linears(self.layers)
        return self

    def to(self, device: str) -> OriginParts:
        self.embed.to(device)
        self.norm.to(device)
        if self.head_weight is not None:
            self.head_weight = self.head_weight.to(device)
        if self.layers is not None:
            self.layers.to(device)
        return self

    def logits(self, hidden):
        """LM-head logits (float32) of hidden states that went through every layer."""
        import torch

        normed = self.norm(hidden)
        if self.head is not None:
            return self.head(normed).float()
        return torch.nn.functional.linear(normed, self.head_weight).float()


def load_origin(model_dir: str | Path, origin_layers: int, dtype=None,
                attn_implementation: str = "sdpa", config: Any = None) -> OriginParts:
    import torch

    dtype = dtype or torch.float32
    config = config or load_config(model_dir)
    tcfg = text_config(config)
    names = list(_weight_files(Path(model_dir)))
    prefix = _prefix(names)
    head_names = [n for n in ("lm_head.weight", "language_model.lm_head.weight") if n in names]
    ends = {f"{prefix}embed_tokens.weight", f"{prefix}norm.weight", *head_names}
    tensors = read_tensors(model_dir, lambda n: n in ends)
    embed = torch.nn.Embedding.from_pretrained(tensors[f"{prefix}embed_tokens.weight"].to(dtype),
                                               freeze=True)
    # The final norm is the same class the model uses (RMSNorm variants differ, e.g. Gemma's +1).
    model_cls_norm = _norm_module(tcfg, dtype)
    model_cls_norm.load_state_dict({"weight": tensors[f"{prefix}norm.weight"].to(dtype)})
    if head_names:
        head_weight = tensors[head_names[0]].to(dtype)
    elif getattr(tcfg, "tie_word_embeddings", getattr(config, "tie_word_embeddings", False)):
        head_weight = embed.weight  # tied: small Llama/SmolLM/Qwen checkpoints have no lm_head
    else:
        raise ValueError("checkpoint has no lm_head.weight and does not tie its embeddings")
    layers = (load_layers(model_dir, 0, origin_layers, dtype, attn_implementation, config)
              if origin_layers else None)
    return OriginParts(embed, model_cls_norm.eval(), head_weight, layers)


def _norm_module(tcfg: Any, dtype):
    """A fresh instance of the model's final norm, built from a one-layer model on meta."""
    import torch
    from transformers import AutoModel

    cfg = copy.deepcopy(tcfg)
    cfg.num_hidden_layers = 1
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = list(cfg.layer_types[:1])
    with torch.device("meta"):
        norm = AutoModel.from_config(cfg).norm
    return norm.to_empty(device="cpu").to(dtype)
