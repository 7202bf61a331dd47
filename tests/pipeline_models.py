"""Tiny random checkpoints built from real transformers config classes, for the pipeline
engine's parity tests (CPU, fp32, no downloads). Each directory also gets the embedded model's
tokenizer, so the engine can serve it: the vocabulary matches SmolLM2's."""

from __future__ import annotations

import shutil
from pathlib import Path

VOCAB = 49152
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")


def _config(kind: str):
    from transformers import LlamaConfig, Qwen3Config

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2)
    if kind == "llama":
        return LlamaConfig(num_hidden_layers=6, tie_word_embeddings=False, **common)
    if kind == "llama-wide":  # head_dim 64: what vLLM's CPU attention needs (it refuses 16)
        return LlamaConfig(**{**common, "hidden_size": 256, "intermediate_size": 512,
                              "max_position_embeddings": 2048},
                           num_hidden_layers=2, tie_word_embeddings=True)
    if kind == "llama-tied":
        return LlamaConfig(num_hidden_layers=5, tie_word_embeddings=True, **common)
    if kind == "qwen3-sliding":
        # Alternating full/sliding attention with a window shorter than the test prompts.
        return Qwen3Config(num_hidden_layers=6, head_dim=16, use_sliding_window=True,
                           sliding_window=5, max_window_layers=0,
                           layer_types=["full_attention", "sliding_attention"] * 3,
                           tie_word_embeddings=False, **common)
    raise ValueError(kind)


def build_tiny(kind: str, target: Path, tokenizer_from: Path | None = None) -> Path:
    """Save a seeded random ``kind`` model (and, if given, a tokenizer) into ``target``."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_config(_config(kind), dtype=torch.float32)
    with torch.no_grad():  # a wider spread than the init default, so tokens vary step to step
        for p in model.parameters():
            p.mul_(4.0 if p.dim() > 1 else 1.0)
    model.save_pretrained(target)
    if tokenizer_from is not None:
        for name in _TOKENIZER_FILES:
            if (tokenizer_from / name).is_file():
                shutil.copy(tokenizer_from / name, target / name)
    return target


def local_pipeline(model_dir: Path, ranges=((1, 3), (3, 6)), controllers=None, **engine_args):
    """A PipelineEngine named "tiny" over ``model_dir`` with its stages in this process
    (``controllers``: an ``engines.kit.config.Controllers``; None: the kind's default)."""
    import msgspec

    from engines.kit.config import ModelConfig
    from engines.pipeline.engine import PipelineEngine
    from engines.pipeline.loading import load_layers
    from engines.pipeline.stage import StageCore
    from engines.pipeline.stages import LocalStages

    config = ModelConfig(name="tiny", engine="pipeline", source=str(model_dir),
                         engine_args={"stages": [list(r) for r in ranges], **engine_args},
                         controllers=msgspec.UNSET if controllers is None else controllers)
    cores = [StageCore(load_layers(model_dir, a, b), a, b) for a, b in ranges]
    return PipelineEngine(config, stages=LocalStages(cores))
