"""vLLM finish reasons → the internal ones (no engine needed)."""

import pytest

from engines.vllm_engine import _finish_reason


@pytest.mark.parametrize("reason, stop_reason, requested, expected", [
    ("stop", None, (), "eos"),
    ("stop", "\n", (), "stop_sequence"),
    ("stop", 7, (7,), "stop_sequence"),  # a stop token id the client asked for
    ("stop", 128009, (), "eos"),  # an extra EOS id vLLM took from generation_config
    ("length", None, (), "length"),
    ("abort", None, (), "abort"),
])
def test_finish_reason(reason, stop_reason, requested, expected):
    assert _finish_reason(reason, stop_reason, requested) == expected
