"""Work bounded before it is done: an oversized prompt is refused before it is tokenized, a
large one is tokenized off the event loop that carries every stream, and the tokenizer threads'
waiting line has a bound (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import random
import threading

import httpx
import msgspec
import pytest

from contract import (
    ChatMessage,
    ChatPrompt,
    ErrorEvent,
    GenerateRequest,
    Sampling,
    TextPrompt,
    TokenPrompt,
)
from engines.kit.embedded import local_model_dir
from engines.kit.tokens import prompt_char_limit
from engines.replica.host import INLINE_CHARS
from engines.replica.offload import Busy, Offload
from gateway.ingress.asgi import create_app
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import MAX_MODEL_LEN, FakeEngine, FakeModel

LIMIT = 4 * MAX_MODEL_LEN  # characters; the fake tokenizer makes one token per character


class _SlowModel(FakeModel):
    """Renders large prompts in two halves with a wait between them that only the event loop
    can end: if rendering held the loop, the wait would time out (``loop_ran`` False)."""

    def __init__(self):
        super().__init__("fake-model", "Hello world", 0.0, "none")
        self.renders: list[tuple[int, str]] = []
        self.started = threading.Event()
        self.loop_went_on = threading.Event()
        self.loop_ran: bool | None = None

    def render(self, prompt):
        text = getattr(prompt, "text", "")
        self.renders.append((len(text), threading.current_thread().name))
        if len(text) > INLINE_CHARS:
            self.started.set()
            self.loop_ran = self.loop_went_on.wait(10)  # a tokenizer in Rust, GIL released
            return [ord("x")] * 8
        return super().render(prompt)


def _host(model=None, limit: int | None = LIMIT) -> FakeEngine:
    engine = FakeEngine()
    if model is not None:
        engine.model = engine.engine = model
    engine.info = msgspec.structs.replace(engine.info, max_prompt_chars=limit)
    return engine


def _request(prompt, max_tokens=4) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="fake-model", prompt=prompt,
                           sampling=Sampling(max_tokens=max_tokens))


async def _events(engine, prompt):
    return [e async for e in engine.generate(_request(prompt))]


@pytest.mark.parametrize("prompt", [
    TextPrompt(text="x" * (LIMIT + 1)),
    ChatPrompt(messages=(ChatMessage(role="user", content="x" * (LIMIT // 2)),
                         ChatMessage(role="user", content="y" * (LIMIT // 2 + 1)))),
    # the template renders roles too: a huge role is as large as a huge content
    ChatPrompt(messages=(ChatMessage(role="r" * (LIMIT + 1), content=""),)),
    TokenPrompt(token_ids=tuple(range(1, MAX_MODEL_LEN + 1))),
])
async def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing_it(prompt):
    model = _SlowModel()
    events = await _events(_host(model), prompt)
    assert len(events) == 1 and isinstance(events[0], ErrorEvent)
    assert events[0].kind == "validation" and events[0].param == "prompt"
    assert "maximum context length" in events[0].message
    assert model.renders == []


async def test_a_prompt_at_the_bound_is_tokenized_and_then_counted():
    events = await _events(_host(limit=LIMIT), TextPrompt(text="x" * LIMIT))
    # LIMIT characters are LIMIT tokens for this tokenizer: over the context, refused by count
    assert isinstance(events[0], ErrorEvent) and "tokens" in events[0].message


async def test_a_large_prompt_is_tokenized_off_the_event_loop():
    """While one request's prompt is tokenized, the loop goes on (it carries every stream)."""
    model = _SlowModel()
    engine = _host(model, limit=None)
    big = asyncio.ensure_future(_events(engine, TextPrompt(text="x" * (INLINE_CHARS + 1))))
    while not model.started.is_set():  # runs only while the loop is free
        await asyncio.sleep(0.001)
    model.loop_went_on.set()  # from the loop, while the render waits in its thread
    await big
    await _events(engine, TextPrompt(text="short"))
    (size, big_thread), (_, small_thread) = model.renders
    assert size == INLINE_CHARS + 1 and big_thread != threading.main_thread().name
    assert model.loop_ran is True
    assert small_thread == threading.main_thread().name  # small ones skip the thread hop


async def test_the_offload_line_is_bounded_and_frees_its_slots():
    offload = Offload(threads=1, max_waiting=1)
    gate = threading.Event()
    first = asyncio.ensure_future(offload.run(gate.wait, 5))
    second = asyncio.ensure_future(offload.run(gate.wait, 5))
    await asyncio.sleep(0.05)
    with pytest.raises(Busy):
        await offload.run(gate.wait, 5)
    second.cancel()  # the caller leaves, the call still holds its slot until it ran
    with pytest.raises(Busy):
        await offload.run(gate.wait, 5)
    gate.set()
    assert await first is True
    await asyncio.sleep(0.05)
    assert await offload.run(lambda: 7) == 7


async def test_tokenize_refuses_an_oversized_prompt_in_the_protocols_shape():
    app = create_app(ModelRegistry({"fake-model": _host(_SlowModel())}))
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
        r = await c.post("/tokenize", json={"model": "fake-model", "prompt": "x" * (LIMIT + 1)})
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"]
        r = await c.post("/generate", json={"inputs": "x" * (LIMIT + 1)})
        assert r.status_code == 422 and r.json()["error_type"] == "validation"
        # TGI's truncate keeps the last tokens: a prompt no context holds still has a tail
        r = await c.post("/generate", json={"inputs": "y" * LIMIT + "abc",
                                            "parameters": {"truncate": 3, "max_new_tokens": 2,
                                                           "decoder_input_details": True}})
        assert r.status_code == 200, r.text
        prefill = r.json()["details"]["prefill"]
        assert "".join(t["text"] for t in prefill) == "abc"


@pytest.fixture(scope="module")
def smollm_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(local_model_dir("embedded:smollm2-135m-instruct"))


def test_the_character_bound_holds_for_the_embedded_tokenizer(smollm_tokenizer):
    """No text of more than ``limit`` characters tokenizes into ``max_model_len`` tokens or
    fewer: checked on texts built to pack many characters into few tokens."""
    limit = prompt_char_limit(smollm_tokenizer, 100)
    assert limit is not None
    longest = limit // 100
    rng = random.Random(0)
    pieces = [" " * 80, "\n" + " " * 80, "the", " the", "é", "日本", "🙂", "\t", "a" * 40, "-" * 64]
    for _ in range(200):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 60)))
        assert len(smollm_tokenizer.encode(text, add_special_tokens=False)) * longest >= len(text)


class _CollapsingTokenizer:
    """A tokenizer whose normalizer drops whitespace (T5's remove_extra_whitespaces, BERT)."""

    def get_vocab(self):
        return {"a": 0, "bb": 1}

    def encode(self, text, add_special_tokens=False):
        return [0] * len(text.replace(" ", "").replace("\n", ""))


def test_no_character_bound_for_a_tokenizer_that_drops_input():
    assert prompt_char_limit(_CollapsingTokenizer(), 100) is None
