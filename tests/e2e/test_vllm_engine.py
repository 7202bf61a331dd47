"""What the vLLM engine kind adds to the contract (the shared rules: tests/contract)."""

from __future__ import annotations

from contract import (
    ErrorEvent,
    GenerateRequest,
    Sampling,
    TextPrompt,
    decode_events,
)


async def _events(engine_handle, request: GenerateRequest) -> list:
    out = []
    async for blob in engine_handle.options(stream=True).generate.remote(request):
        out.extend(decode_events(blob))
    return out


async def test_last_token_is_flagged_before_its_final_event(engine_handle):
    request = GenerateRequest(request_id="last-1", model="m", prompt=TextPrompt(text="Hi"),
                              sampling=Sampling(temperature=0, max_tokens=4))
    events = await _events(engine_handle, request)
    assert [type(e).__name__ for e in events] == ["TokenEvent"] * 4 + ["FinalEvent"]
    assert [e.last for e in events[:4]] == [False, False, False, True]


async def test_vllm_side_validation_is_a_validation_error(engine_handle):
    # greedy with n > 1 passes admission but vLLM refuses it (VLLMValidationError)
    request = GenerateRequest(request_id="val-1", model="m", prompt=TextPrompt(text="Hi"),
                              sampling=Sampling(temperature=0, n=2, max_tokens=2))
    [event] = await _events(engine_handle, request)
    assert isinstance(event, ErrorEvent) and event.kind == "validation"


async def test_model_info_reports_vllm_and_its_dtype(engine_handle):
    info = await engine_handle.model_info.remote()
    assert info.engine == "vllm" and info.dtype in ("float32", "bfloat16", "float16")
    assert info.capabilities.controllers == "mask" and not info.capabilities.best_of_above_n
