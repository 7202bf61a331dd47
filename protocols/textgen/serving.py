"""Starting a text-generation request, shared by the LMI and TGI routes (no HTTP here)."""

from __future__ import annotations

import logging
import uuid

from contract import (
    AdapterNotFound,
    EngineUnavailable,
    ErrorEvent,
    GenerateRequest,
    InvalidPrompt,
    TextPrompt,
    TokenPrompt,
)
from contract.client import EngineClient, ModelDirectory
from protocols.streams import Peeked, peek
from protocols.textgen.encode import GenerationFailed, ResponseMeta
from protocols.textgen.params import Generation

__all__ = ["STREAM_HEADERS", "response_meta", "start_generation", "with_adapter"]

log = logging.getLogger(__name__)

STREAM_HEADERS = {"Cache-Control": "no-cache"}


def with_adapter(models: ModelDirectory, model: str, engine: EngineClient, adapter: str | None,
                 param: str = "adapter_id") -> tuple[str, EngineClient]:
    """Model ``model`` running LoRA adapter ``adapter`` (None: as it is). Raises
    :class:`GenerationFailed` (not found) when the model has no such adapter."""
    if adapter is None:
        return model, engine
    try:
        return models.resolve_adapter(model, adapter)
    except AdapterNotFound as exc:
        raise GenerationFailed(ErrorEvent(kind="not_found", message=str(exc),
                                          param=param)) from None


async def start_generation(engine: EngineClient, model: str, inputs: str,
                           gen: Generation) -> Peeked:
    """Submit one prompt and peek its first event. Raises :class:`GenerationFailed`."""
    prompt: TextPrompt | TokenPrompt = TextPrompt(text=inputs)
    if gen.truncate is not None:  # TGI / lmi-dist `truncate`: keep the last N prompt tokens
        try:
            ids = await _truncatable_ids(engine, inputs)
        except EngineUnavailable as exc:
            raise GenerationFailed(exc.event()) from exc
        except InvalidPrompt as exc:
            raise GenerationFailed(ErrorEvent(kind="validation", message=str(exc),
                                              param="inputs")) from None
        except Exception as exc:  # the detail (maybe addresses, traces) goes to the log only
            log.exception("tokenize for %s failed", model)
            raise GenerationFailed(ErrorEvent(kind="engine", message="tokenize failed")) from exc
        if len(ids) > gen.truncate:
            prompt = TokenPrompt(token_ids=ids[-gen.truncate:])
    request = GenerateRequest(request_id=uuid.uuid4().hex, model=model, prompt=prompt,
                              sampling=gen.sampling, output=gen.output,
                              controller=gen.controller)
    peeked = await peek(engine.generate(request))
    if peeked.error is not None:
        raise GenerationFailed(peeked.error)
    return peeked


async def _truncatable_ids(engine: EngineClient, inputs: str) -> tuple[int, ...]:
    """Token ids of ``inputs``, or of its tail when the whole is longer than any prompt that
    fits the context: that tail still holds more tokens than the context (each token covers
    at most ``max_prompt_chars / max_model_len`` characters), so its last ones are the last
    ones of the whole."""
    try:
        return await engine.tokenize(TextPrompt(text=inputs))
    except InvalidPrompt:
        limit = (await engine.model_info()).max_prompt_chars
        if limit is None:
            raise
        return await engine.tokenize(TextPrompt(text=inputs[-limit:]))


async def response_meta(models: ModelDirectory, model: str, inputs: str,
                        gen: Generation) -> ResponseMeta:
    try:
        eos_token_id = (await models.info(model)).eos_token_id
    except EngineUnavailable as exc:
        raise GenerationFailed(exc.event()) from exc
    except Exception as exc:
        log.exception("model info for %s failed", model)
        raise GenerationFailed(ErrorEvent(kind="engine", message="model info failed")) from exc
    return ResponseMeta(inputs=inputs, details=gen.details, return_full_text=gen.return_full_text,
                        prefill=gen.prefill, top_n_tokens=gen.top_n_tokens, seed=gen.seed,
                        eos_token_id=eos_token_id)
