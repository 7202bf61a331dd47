"""engines.kit.detokenize: each token's text, with a real tokenizer (the embedded model's)."""

from __future__ import annotations

import pytest

from engines.kit.detokenize import IncrementalDecoder


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from engines.kit.embedded import prepare_embedded_model

    return AutoTokenizer.from_pretrained(str(prepare_embedded_model()))


@pytest.mark.parametrize("text", ["Hello world, ça va? 你好 🙂 done.", "  two  spaces\n\nand lines"])
def test_the_pieces_add_up_to_the_whole_decode(tokenizer, text):
    prompt = tokenizer.encode("Say:")
    ids = tokenizer.encode(" " + text)
    decoder = IncrementalDecoder(tokenizer, prompt[-5:], skip_special_tokens=True)
    pieces = [decoder.add(i) for i in ids]
    assert "".join(pieces) == tokenizer.decode(prompt + ids)[len(tokenizer.decode(prompt)):]
    assert all("\ufffd" not in p for p in pieces)  # a split character waits for its last byte


def test_a_long_sequence_keeps_a_short_window(tokenizer):
    ids = tokenizer.encode(" word" * 400)
    decoder = IncrementalDecoder(tokenizer, [], skip_special_tokens=True)
    assert "".join(decoder.add(i) for i in ids) == tokenizer.decode(ids)
    assert len(decoder._ids) < 100
