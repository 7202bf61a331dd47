"""Prompt rendering shared by engine kinds that own a Hugging Face tokenizer."""

from __future__ import annotations

from typing import Any

from engines.base import PromptError
from protocols.internal import ChatPrompt, Prompt, TextPrompt, TokenPrompt

__all__ = ["render_prompt"]


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``: token prompts as they are, text through the tokenizer, chat
    through the model's chat template (rendered to text first, as vLLM does). Raises
    :class:`PromptError` when the tokenizer or template refuses it."""
    try:
        if isinstance(prompt, TokenPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        if isinstance(prompt, ChatPrompt):
            text = tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in prompt.messages],
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tokenize=False,
            )
            return tokenizer.encode(text, add_special_tokens=False)
    except Exception as exc:  # the tokenizer or the chat template refused this prompt
        raise PromptError(str(exc)) from exc
    raise PromptError(f"unsupported prompt type {type(prompt).__name__}")
