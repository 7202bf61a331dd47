"""OpenAI body → internal request mapping."""

import msgspec

from contract import TextPrompt, TokenPrompt
from protocols.openai.schemas import ChatCompletionRequest, CompletionRequest
from protocols.openai.translate import chat_request, completion_requests


def _completion(**body):
    return completion_requests(msgspec.convert(body, CompletionRequest), "m", "rid")


def test_sampling_mapping():
    [req] = _completion(prompt="x", max_tokens=7, temperature=0, top_k=-1, top_p=0.5,
                        stop="END", logit_bias={"42": -100}, ignore_eos=True, seed=9,
                        repetition_penalty=1.1, min_tokens=2, stop_token_ids=[2], priority=3)
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_k, s.top_p) == (7, 0, 0, 0.5)
    assert s.stop == ("END",) and s.logit_bias == {42: -100.0} and s.stop_token_ids == (2,)
    assert s.ignore_eos and s.seed == 9 and s.repetition_penalty == 1.1 and s.min_tokens == 2
    assert req.priority == 3 and req.request_id == "rid" and req.model == "m"
    assert req.output.logprobs is None


def test_prompt_shapes_and_request_ids():
    reqs = _completion(prompt=["a", "b"])
    assert [r.prompt for r in reqs] == [TextPrompt(text="a"), TextPrompt(text="b")]
    assert [r.request_id for r in reqs] == ["rid-0", "rid-1"]
    [req] = _completion(prompt=[1, 2, 3], add_special_tokens=False)
    assert req.prompt == TokenPrompt(token_ids=(1, 2, 3))


def test_chat_defaults_and_logprobs():
    body = msgspec.convert({"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                            "top_logprobs": 3, "max_tokens": 5, "max_completion_tokens": 9},
                           ChatCompletionRequest)
    req, _ = chat_request(body, "m", "rid")
    assert req.sampling.max_tokens == 9  # max_completion_tokens wins
    assert req.output.logprobs == 3
    plain, _ = chat_request(msgspec.convert({"messages": [{"role": "user", "content": "hi"}]},
                                         ChatCompletionRequest), "m", "rid")
    assert plain.sampling.max_tokens is None  # up to the context limit
    assert plain.output.logprobs is None
