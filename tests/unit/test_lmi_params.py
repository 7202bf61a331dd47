"""LMI GenerationParameters / TGI GenerateParameters → internal request options."""

import pytest

from protocols.textgen.params import (
    LMI,
    LMI_TGI_COMPAT,
    TGI,
    InvalidParameters,
    parse_body,
    parse_parameters,
)
from tests.seed_examples import LMI_SEED_REQUEST


def _lmi(stream=False, **params):
    return parse_parameters(params, LMI, stream=stream)


def _tgi(stream=False, **params):
    return parse_parameters(params, TGI, stream=stream)


def test_seed_request_maps_every_field():
    inputs, params, stream = parse_body(LMI_SEED_REQUEST, allow_list=True)
    gen = parse_parameters(params, LMI, stream=stream)
    assert inputs == "What is Deep Learning?" and stream is True
    assert gen.sampling.temperature == 1.0 and gen.sampling.max_tokens == 256  # do_sample
    assert gen.details and gen.output.logprobs == 0  # every token reports its log_prob


def test_lmi_defaults_are_greedy_30_tokens_no_details():
    gen = _lmi()
    s = gen.sampling
    assert (s.temperature, s.max_tokens, s.n, s.seed) == (0.0, 30, 1, None)
    assert not gen.details and not gen.return_full_text and not gen.prefill
    assert LMI_TGI_COMPAT.default_details and parse_parameters({}, LMI_TGI_COMPAT,
                                                               stream=False).details


def test_tgi_defaults():
    gen = _tgi()
    assert gen.sampling.temperature == 0.0 and gen.sampling.max_tokens == 100


def test_common_parameters_map_to_sampling():
    gen = _lmi(do_sample=True, seed=7, temperature=0.5, repetition_penalty=1.2, top_k=10,
               top_p=0.9, max_new_tokens=12, stop_sequences=["\n"], return_full_text=True,
               decoder_input_details=True, details=True)
    s = gen.sampling
    assert (s.temperature, s.seed, s.repetition_penalty, s.top_k, s.top_p, s.max_tokens,
            s.stop) == (0.5, 7, 1.2, 10, 0.9, 12, ("\n",))
    assert gen.return_full_text and gen.prefill and gen.details and gen.seed == 7
    assert gen.output.prompt_logprobs == 0


def test_vllm_extras_map():
    gen = _lmi(do_sample=True, min_p=0.1, presence_penalty=0.5, frequency_penalty=-0.5,
               stop_token_ids=[2, 3], include_stop_str_in_output=True, ignore_eos_token=True,
               logprobs=3, prompt_logprobs=1, skip_special_tokens=False,
               spaces_between_special_tokens=False, n=2, best_of=3)
    s, o = gen.sampling, gen.output
    assert (s.min_p, s.presence_penalty, s.frequency_penalty) == (0.1, 0.5, -0.5)
    assert s.stop_token_ids == (2, 3) and s.include_stop_str_in_output and s.ignore_eos
    assert o.logprobs == 3 and gen.top_n_tokens == 3 and o.prompt_logprobs == 0 and gen.prefill
    assert gen.details  # prefill lives in details, so asking for it turns details on
    assert not o.skip_special_tokens and not o.spaces_between_special_tokens
    assert s.n == 3  # max(n, best_of) sequences are sampled, the most likely one on top


@pytest.mark.parametrize("params", [{"stop": ["x"]}, {"stop": "x"}, {"stop_sequences": "x"}])
def test_stop_spellings(params):
    assert _lmi(**params).sampling.stop == ("x",)


def test_aliases_and_nulls():
    gen = _lmi(max_tokens=5, ignore_eos=True, temperature=None, top_p=None)
    assert gen.sampling.max_tokens == 5 and gen.sampling.ignore_eos
    assert gen.sampling.temperature == 0.0  # nulls are unset: still greedy


def test_sampling_decided_by_knobs_when_do_sample_absent():
    assert _lmi(temperature=0.7).sampling.temperature == 0.7
    assert _lmi(top_k=5).sampling.top_k == 5
    assert _lmi(temperature=0.7, do_sample=False).sampling.temperature == 0.0  # LMI: explicit wins
    assert _lmi(do_sample=True, temperature=0).sampling.temperature == 0.0  # LMI: 0 is greedy
    # TGI's strict client always sends do_sample=false; knobs still mean sampling there
    assert _tgi(do_sample=False, temperature=0.7).sampling.temperature == 0.7
    assert _lmi(top_k=-1).sampling.temperature == 0.0 and _lmi(top_k=0).sampling.top_k == 0


def test_seed_only_reported_when_sampling():
    assert _lmi(seed=3).seed is None and _lmi(seed=3).sampling.seed is None
    assert _tgi(seed=3, do_sample=True).seed == 3


def test_top_level_knobs_count_and_parameters_win():
    _, params, _ = parse_body({"inputs": "x", "max_new_tokens": 4, "temperature": 0.3,
                               "parameters": {"max_new_tokens": 6}}, allow_list=False)
    gen = _lmi(**params)
    assert gen.sampling.max_tokens == 6 and gen.sampling.temperature == 0.3


def test_unknown_parameters_are_ignored():
    assert _lmi(frobnicate=1, max_new_tokens=2).sampling.max_tokens == 2


def test_beam_only_knobs_accepted_without_beams():
    assert _lmi(num_beams=1, length_penalty=0.5, early_stopping=True).sampling.max_tokens == 30


@pytest.mark.parametrize("params, field", [
    ({"max_new_tokens": "x"}, "max_new_tokens"), ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"), ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -2}, "top_k"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"min_p": 2}, "min_p"), ({"do_sample": "yes"}, "do_sample"), ({"details": 1}, "details"),
    ({"seed": -1}, "seed"), ({"seed": True}, "seed"), ({"stop_sequences": [1]}, "stop_sequences"),
    ({"stop_sequences": [""]}, "stop_sequences"), ({"stop_token_ids": ["a"]}, "stop_token_ids"),
    ({"n": 0}, "n"), ({"best_of": 0}, "best_of"), ({"logprobs": -1}, "logprobs"),
    ({"num_beams": 2}, "num_beams"), ({"typical_p": 0.5}, "typical_p"),
    ({"watermark": True}, "watermark"), ({"grammar": {"type": "xml", "value": "x"}}, "grammar"),
    ({"grammar": {"type": "regex"}}, "grammar"), ({"controller": 5}, "controller"),
    ({"controller_arg": "x"}, "controller"),
    ({"adapters": ["a", "b"]}, "adapters"), ({"truncate": 0}, "truncate"),
    ({"n": 2}, "sampling"), ({"best_of": 2, "do_sample": False}, "sampling"),
    ({"prompt_logprobs": 2}, "prompt_logprobs"),
])
def test_lmi_invalid_parameters_name_the_field(params, field):
    with pytest.raises(InvalidParameters, match=field):
        _lmi(**params)


def test_n_and_best_of_refused_on_streams():
    with pytest.raises(InvalidParameters, match="streaming"):
        _lmi(stream=True, do_sample=True, n=2)


@pytest.mark.parametrize("params, field", [
    ({"temperature": 0}, "temperature"), ({"top_k": 0}, "top_k"), ({"top_p": 1.0}, "top_p"),
    ({"typical_p": 1.0}, "typical_p"), ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"best_of": 3, "do_sample": True}, "best_of"), ({"top_n_tokens": 6}, "top_n_tokens"),
    ({"best_of": 2, "do_sample": True, "seed": 1}, "seed"),
])
def test_tgi_ranges_are_stricter(params, field):
    with pytest.raises(InvalidParameters, match=field):
        _tgi(**params)


def test_tgi_refuses_prefill_on_streams_lmi_allows_it():
    with pytest.raises(InvalidParameters, match="decoder_input_details"):
        _tgi(stream=True, decoder_input_details=True)
    assert _lmi(stream=True, decoder_input_details=True).prefill


def test_tgi_ignores_lmi_only_extras():
    assert _tgi(n=3).sampling.n == 1


@pytest.mark.parametrize("body", [[], "x", {"parameters": {}}, {"inputs": ""}, {"inputs": 3},
                                  {"inputs": "x", "parameters": []},
                                  {"inputs": "x", "stream": "yes"}])
def test_bad_bodies(body):
    with pytest.raises(InvalidParameters):
        parse_body(body, allow_list=True)


def test_list_inputs_only_where_allowed():
    assert parse_body({"inputs": ["a", "b"]}, allow_list=True)[0] == ["a", "b"]
    with pytest.raises(InvalidParameters):
        parse_body({"inputs": ["a", "b"]}, allow_list=False)  # TGI: a string only
    for bad in ({"inputs": []}, {"inputs": ["a", 1]}, {"inputs": ["a", ""]}):
        with pytest.raises(InvalidParameters):
            parse_body(bad, allow_list=True)


def test_grammar_and_controller_fields_become_the_request_controller():
    import json

    gen = _lmi(grammar={"type": "regex", "value": "[0-9]+/x"})
    assert gen.controller.module == "llguidance"
    assert json.loads(gen.controller.arg) == {
        "grammar": {"grammars": [{"lark_grammar": "start: /[0-9]+\\/x/"}]}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    gen = _lmi(grammar={"type": "json", "value": json.dumps(schema)})
    assert json.loads(gen.controller.arg)["grammar"]["grammars"][0]["json_schema"] == schema
    gen = _lmi(controller="mine", controller_arg={"k": 1})
    assert (gen.controller.module, gen.controller.arg) == ("mine", '{"k": 1}')
    assert _lmi().controller is None
