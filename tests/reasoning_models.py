"""A test model that reasons: the embedded model's tokenizer with two of its unused special
tokens renamed ``<think>`` and ``</think>`` (plain, not special: shown in text, as Qwen3's
are) and a chat template whose generation prompt opens a think block, as DeepSeek-R1's and
Qwen3's do (closed at once, as Qwen3's, when ``enable_thinking`` is false). vLLM's
``deepseek_r1`` reasoning parser reads it (docs/reasoning.md)."""

from __future__ import annotations

import json
from pathlib import Path

THINK, END = "<think>", "</think>"
_RENAMED = {"<issue_start>": THINK, "<issue_comment>": END}  # ids 8 and 9, unused in chat
_GENERATION_PROMPT = "'<|im_start|>assistant\n'"


def make_reasoning_tokenizer(model_dir: Path) -> Path:
    """Rewrite the tokenizer files in ``model_dir`` (copied there by ``build_tiny``)."""
    path = model_dir / "tokenizer.json"
    tokenizer = json.loads(path.read_text())
    for token in tokenizer["added_tokens"]:
        if token["content"] in _RENAMED:
            token["content"], token["special"] = _RENAMED[token["content"]], False
    vocab = tokenizer["model"]["vocab"]
    for old, new in _RENAMED.items():
        vocab[new] = vocab.pop(old)
    path.write_text(json.dumps(tokenizer))
    template = model_dir / "chat_template.jinja"
    text = template.read_text()
    assert _GENERATION_PROMPT in text, "the embedded model's chat template changed"
    # Qwen3's switch: enable_thinking=false closes the think block in the prompt itself.
    opened = f"'<|im_start|>assistant\n{THINK}\n'"
    closed = f"'<|im_start|>assistant\n{THINK}\n\n{END}\n\n'"
    template.write_text(text.replace(
        _GENERATION_PROMPT,
        f"({closed} if enable_thinking is defined and not enable_thinking else {opened})"))
    return model_dir
