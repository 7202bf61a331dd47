"""The engine contract itself, through the real Serve deployment (no protocol in between)."""

from __future__ import annotations

from protocols.internal import (
    ControllerSpec,
    ErrorEvent,
    FinalEvent,
    GenerateRequest,
    Sampling,
    TextPrompt,
    TokenEvent,
    decode_events,
)


async def _events(engine_handle, request: GenerateRequest) -> list:
    out = []
    async for blob in engine_handle.options(stream=True).generate.remote(request):
        out.extend(decode_events(blob))
    return out


async def test_deadline_aborts_and_ends_the_stream(engine_handle):
    request = GenerateRequest(request_id="deadline-1", model="m",
                              prompt=TextPrompt(text="Count to a thousand:"),
                              sampling=Sampling(max_tokens=1500, ignore_eos=True),
                              timeout_s=1.0)
    events = await _events(engine_handle, request)
    final = events[-1]
    assert isinstance(final, FinalEvent)
    assert final.finish_reason == "abort" and final.stop_reason == "timeout"
    tokens = [e for e in events if isinstance(e, TokenEvent)]
    assert 0 < len(tokens) < 1500 and final.usage.completion_tokens == len(tokens)
    stats = await engine_handle.stats.remote()
    assert stats["active"] == 0


async def test_last_token_is_flagged_before_its_final_event(engine_handle):
    request = GenerateRequest(request_id="last-1", model="m", prompt=TextPrompt(text="Hi"),
                              sampling=Sampling(temperature=0, max_tokens=4))
    events = await _events(engine_handle, request)
    assert [type(e).__name__ for e in events] == ["TokenEvent"] * 4 + ["FinalEvent"]
    assert [e.last for e in events[:4]] == [False, False, False, True]


async def test_controller_requests_are_refused_until_supported(engine_handle):
    request = GenerateRequest(request_id="ctl-1", model="m", prompt=TextPrompt(text="Hi"),
                              controller=ControllerSpec(module="x"))
    [event] = await _events(engine_handle, request)
    assert isinstance(event, ErrorEvent) and event.kind == "validation"
    assert event.param == "controller"


async def test_vllm_side_validation_is_a_validation_error(engine_handle):
    # greedy with n > 1 passes our checks but vLLM refuses it (VLLMValidationError)
    request = GenerateRequest(request_id="val-1", model="m", prompt=TextPrompt(text="Hi"),
                              sampling=Sampling(temperature=0, n=2, max_tokens=2))
    [event] = await _events(engine_handle, request)
    assert isinstance(event, ErrorEvent) and event.kind == "validation"
