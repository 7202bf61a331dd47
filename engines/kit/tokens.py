"""Prompt rendering shared by engine kinds that own a Hugging Face tokenizer, and the bound that
lets admission refuse an oversized text prompt before tokenizing any of it
(docs/reliability.md, "Work bounded before it is done")."""

from __future__ import annotations

import logging
from typing import Any

from jinja2 import TemplateError

from contract import ChatPrompt, Prompt, TextPrompt, TokenPrompt, reserved_template_kwargs
from engines.kit.base import PromptError
from engines.kit.tool_prompts import template_inputs

__all__ = ["prompt_char_limit", "render_prompt"]

log = logging.getLogger(__name__)

# Inputs a tokenizer could shrink before splitting them into tokens (whitespace runs, control
# and zero-width characters, combining marks): where any of them gives fewer tokens than the
# bound assumes, no character bound holds for that tokenizer.
_SHRINK_PROBES = (" ", "\n", "\t", "\r\n", "\x00", "\x7f", "\u200b", "\u00a0", "\ufeff",
                  "e\u0301", "\u3000", "a ")
_PROBE_REPEAT = 512


def render_prompt(tokenizer: Any, prompt: Prompt) -> list[int]:
    """Token ids of ``prompt``: token prompts as they are, text through the tokenizer, chat
    through the model's chat template (rendered to text first, as vLLM does). Raises
    :class:`PromptError` when the tokenizer or template refuses it."""
    reserved = isinstance(prompt, ChatPrompt) and reserved_template_kwargs(prompt.template_kwargs)
    if reserved:
        raise PromptError(f"chat template variables the gateway sets itself: "
                          f"{', '.join(reserved)}")
    try:
        if isinstance(prompt, TokenPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        if isinstance(prompt, ChatPrompt):
            messages, tools = template_inputs(getattr(tokenizer, "chat_template", None), prompt)
            text = tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tokenize=False,
                **prompt.template_kwargs,
            )
            return tokenizer.encode(text, add_special_tokens=False)
    except TemplateError as exc:
        if type(exc) is TemplateError:  # raise_exception: the template's own words
            raise PromptError(str(exc)) from exc
        log.warning("the chat template failed: %r", exc)  # jinja's text: the log's only
        raise PromptError("the chat template could not render these messages") from exc
    except Exception as exc:  # the tokenizer's: Python's text, for the log only
        log.warning("the tokenizer refused a prompt: %r", exc)
        raise PromptError("the tokenizer could not encode this prompt") from exc
    raise PromptError(f"unsupported prompt type {type(prompt).__name__}")


def prompt_char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a text or chat prompt can have and still fit ``max_model_len``
    tokens, or ``None`` where no such bound holds for this tokenizer.

    A token covers at most as many characters as its vocabulary string has (byte-level BPE: one
    string character per byte, so at most one text character; SentencePiece: ``▁`` is one
    space, a byte-fallback ``<0xNN>`` one byte; tiktoken-style bytes keys: one byte each), so
    ``n`` tokens cover at most ``n * longest`` characters, unless the tokenizer drops or
    merges input before splitting it, which the probes check. Any failure here: no bound.
    """
    try:
        return _char_limit(tokenizer, max_model_len)
    except Exception as exc:  # an unusual tokenizer must not keep the engine from starting
        log.warning("no prompt size bound for this tokenizer: %r", exc)
        return None


def _char_limit(tokenizer: Any, max_model_len: int) -> int | None:
    longest = max(len(token) for token in tokenizer.get_vocab())
    for probe in _SHRINK_PROBES:
        text = probe * _PROBE_REPEAT
        tokens = len(tokenizer.encode(text, add_special_tokens=False))
        if tokens * longest < len(text):
            log.warning("tokenizer shrinks %r: prompts are tokenized whatever their size", probe)
            return None
    return max_model_len * longest
