"""The internal model: frozen, tagged, and round-trips through the inter-process codec."""

import msgspec
import pytest

from contract import (
    BacktrackEvent,
    ChatMessage,
    ChatPrompt,
    ErrorEvent,
    FinalEvent,
    ForkEvent,
    GenerateRequest,
    PromptEvent,
    PromptToken,
    Sampling,
    TextPrompt,
    Timings,
    TokenEvent,
    TokenPrompt,
    TopLogprob,
    Usage,
    decode_events,
    encode_events,
)


def test_events_round_trip_through_msgpack():
    events = [
        PromptEvent(text="hi", tokens=(PromptToken(token_id=5, text="hi"),)),
        TokenEvent(index=1, token_id=7, text=" a", logprob=-0.5,
                   top_logprobs=(TopLogprob(token_id=7, text=" a", logprob=-0.5),), special=False),
        FinalEvent(index=1, finish_reason="stop_sequence", stop_reason="\n",
                   usage=Usage(prompt_tokens=3, completion_tokens=4),
                   timings=Timings(queue_s=0.1, ttft_s=0.2, decode_s=0.3)),
        ErrorEvent(kind="validation", message="bad", param="max_tokens"),
    ]
    assert decode_events(encode_events(events)) == events


def test_structs_are_frozen():
    request = GenerateRequest(request_id="r", model="m", prompt=TextPrompt(text="x"))
    with pytest.raises(AttributeError):
        request.model = "other"


def test_prompt_union_is_tagged():
    for prompt in (TextPrompt(text="x"), TokenPrompt(token_ids=(1, 2)),
                   ChatPrompt(messages=(ChatMessage(role="user", content="hi"),))):
        request = GenerateRequest(request_id="r", model="m", prompt=prompt)
        assert msgspec.json.decode(msgspec.json.encode(request), type=GenerateRequest) == request


def test_sampling_carries_what_every_protocol_needs():
    sampling = Sampling(temperature=0, logit_bias={5: 100.0, 9: -100.0}, stop_token_ids=(2,),
                        min_tokens=1, n=2, best_of=2, ignore_eos=True, seed=7)
    decoded = msgspec.json.decode(msgspec.json.encode(sampling), type=Sampling)
    assert decoded.logit_bias == {5: 100.0, 9: -100.0}
    assert decoded == sampling


def test_splice_events_round_trip_and_usage_splits_sampled_from_forced():
    events = [
        TokenEvent(index=0, token_id=5, text="a", forced=True),
        BacktrackEvent(index=0, count=1, text="a"),
        ForkEvent(index=2, parent=0),
        FinalEvent(index=2, finish_reason="length",
                   usage=Usage(prompt_tokens=3, completion_tokens=4, forced_tokens=1,
                               sampled_tokens=6)),
    ]
    assert decode_events(encode_events(events)) == events
    assert Usage(prompt_tokens=1, completion_tokens=5, forced_tokens=2).sampled == 3
    assert events[-1].usage.sampled == 6


def test_append_only_defaults_keep_the_wire_format_unchanged():
    # omit_defaults: events without splices encode exactly as before the splice fields existed
    token = TokenEvent(token_id=7, text=" a")
    assert msgspec.json.encode(token) == b'{"type":"token","token_id":7,"text":" a"}'
    usage = Usage(prompt_tokens=1, completion_tokens=2)
    assert msgspec.json.encode(usage) == b'{"prompt_tokens":1,"completion_tokens":2}'
