"""Random LoRA adapters made with ``peft`` for the adapter tests and bench (docs/adapters.md)."""

from __future__ import annotations

from pathlib import Path

# Every projection of a Llama block: an adapter on all of them moves the output the most.
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_random_adapter(base_dir: Path, target: Path, seed: int, rank: int = 8) -> Path:
    """A random LoRA of ``rank`` on the model in ``base_dir``, saved by peft into ``target``.
    peft starts B at zero (an adapter that changes nothing): both factors are drawn at random
    and scaled up here, so the greedy output moves off the base model's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                                  target_modules=TARGETS,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.5)
    peft_model.save_pretrained(target)
    return target
