"""vLLM finish reasons → the internal ones (no engine needed)."""

import pytest

from engines.vllm.translate import finish_reason


@pytest.mark.parametrize("reason, stop_reason, requested, expected", [
    ("stop", None, (), "eos"),
    ("stop", "\n", (), "stop_sequence"),
    ("stop", 7, (7,), "stop_sequence"),  # a stop token id the client asked for
    ("stop", 128009, (), "eos"),  # an extra EOS id vLLM took from generation_config
    ("length", None, (), "length"),
    ("abort", None, (), "abort"),
])
def test_finish_reason(reason, stop_reason, requested, expected):
    assert finish_reason(reason, stop_reason, requested) == expected
