"""LoRA adapters in OpenAI's model listing, and vLLM's routes that load and unload them at
runtime (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``; docs/adapters.md). No HTTP
here: the routes hand the body over and wrap the result.

Beyond vLLM's bodies, ``model`` names the model an adapter is for; it may be left out while
one model has adapters (vLLM serves one model). ``load_inplace`` is vLLM's way to swap the
weights under a name; here a name is unloaded and loaded again instead (the replicas then load
the new folder, whatever they held under that name).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import msgspec

from contract import AdapterInvalid, ModelNotFound, ModelRequired
from contract.client import ModelDirectory
from protocols.openai.errors import OpenAIError
from protocols.openai.translate import decode_body

__all__ = ["adapter_cards", "load_adapter", "unload_adapter"]

T = TypeVar("T")


class LoadAdapter(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    lora_path: str
    model: str | None = None
    load_inplace: bool = False


class UnloadAdapter(msgspec.Struct, frozen=True, kw_only=True):
    lora_name: str
    model: str | None = None
    lora_int_id: int | None = None  # vLLM's; names are what identify adapters here


def _in_shape(call: Callable[[], T], param: str) -> T:
    """``call()``, the model directory's refusals as OpenAI's errors (``param``: what an
    invalid adapter is blamed on)."""
    try:
        return call()
    except AdapterInvalid as exc:
        raise OpenAIError(400, str(exc), param) from None
    except ModelNotFound as exc:
        raise OpenAIError(404, str(exc), "model") from None
    except ModelRequired as exc:
        raise OpenAIError(400, str(exc), "model") from None


def adapter_cards(models: ModelDirectory) -> list[dict]:
    """``/v1/models`` entries of the adapters, as vLLM lists them (``parent``: the model)."""
    created = int(time.time())
    return [{"id": name, "object": "model", "created": created, "owned_by": "llm-gateway",
             "root": name, "parent": parent, "permission": []}
            for name, parent in models.adapters()]


def load_adapter(raw: bytes, models: ModelDirectory) -> str:
    body = decode_body(raw, LoadAdapter)

    def load() -> None:
        if body.load_inplace:
            models.unload_adapter(body.model, body.lora_name)
        models.load_adapter(body.model, body.lora_name, body.lora_path)

    _in_shape(load, "lora_name")
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


def unload_adapter(raw: bytes, models: ModelDirectory) -> str:
    body = decode_body(raw, UnloadAdapter)
    removed = _in_shape(lambda: models.unload_adapter(body.model, body.lora_name), "model")
    if not removed:
        raise OpenAIError(404, f"The lora adapter '{body.lora_name}' cannot be found (only "
                          "adapters loaded at runtime can be unloaded).", "lora_name")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."
