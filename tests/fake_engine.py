"""A deterministic in-process engine implementing the engine contract, for protocol unit tests.

Tokenizer: one token per character (id = code point). Generation: choice ``i`` emits the
characters of ``reply`` (default "abcdefgh...") cycling, each with logprob ``-0.1 * (k+1)``; EOS
(id 0) ends it when ``reply`` runs out, unless ``ignore_eos``. A stop string ends the choice
with ``stop_sequence``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from protocols.internal import (
    ChatPrompt,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerateRequest,
    ModelInfo,
    Prompt,
    PromptEvent,
    PromptToken,
    TextPrompt,
    TokenEvent,
    TokenPrompt,
    TopLogprob,
    Usage,
)

MAX_MODEL_LEN = 64
VOCAB = 0x110000


class FakeEngine:
    def __init__(self, name: str = "fake-model", reply: str = "Hello world", delay: float = 0.0):
        self.name = name
        self.reply = reply
        self.delay = delay
        self.requests: list[GenerateRequest] = []
        self.cancelled: list[str] = []
        self.active: set[str] = set()

    async def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.name, root=f"/models/{self.name}", max_model_len=MAX_MODEL_LEN,
                         vocab_size=VOCAB, eos_token_id=0)

    async def check_health(self) -> None:
        return None

    def _render(self, prompt: Prompt) -> tuple[int, ...]:
        if isinstance(prompt, TokenPrompt):
            return prompt.token_ids
        if isinstance(prompt, TextPrompt):
            return tuple(ord(c) for c in prompt.text)
        assert isinstance(prompt, ChatPrompt)
        text = "".join(f"<{m.role}>{m.content}" for m in prompt.messages) + "<assistant>"
        return tuple(ord(c) for c in text)

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        return self._render(prompt)

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return "".join(chr(t) for t in token_ids)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        ids = self._render(request.prompt)
        s = request.sampling
        if not ids:
            yield ErrorEvent(kind="validation", message="prompt is empty", param="prompt")
            return
        room = MAX_MODEL_LEN - len(ids)
        max_tokens = room if s.max_tokens is None else s.max_tokens
        if max_tokens > room:
            yield ErrorEvent(kind="validation", message="context length exceeded",
                             param="max_tokens")
            return
        self.active.add(request.request_id)
        try:
            if request.output.echo or request.output.prompt_logprobs is not None:
                yield PromptEvent(
                    text="".join(chr(t) for t in ids),
                    tokens=tuple(PromptToken(token_id=t, text=chr(t),
                                             logprob=None if i == 0 else -float(i))
                                 for i, t in enumerate(ids)),
                )
            for index in range(s.n):
                async for event in self._choice(request, index, len(ids), max_tokens):
                    yield event
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise
        except GeneratorExit:
            self.cancelled.append(request.request_id)
            raise
        finally:
            self.active.discard(request.request_id)

    async def _choice(self, request, index, prompt_len, max_tokens) -> AsyncIterator[Event]:
        s, k = request.sampling, request.output.logprobs
        text = ""
        for step in range(max_tokens):
            if self.delay:
                await asyncio.sleep(self.delay)
            if step >= len(self.reply) and not s.ignore_eos:
                yield TokenEvent(index=index, token_id=0, text="", logprob=-0.01, special=True,
                                 last=True)
                yield self._final(index, "eos", None, prompt_len, step + 1)
                return
            char = self.reply[step % len(self.reply)]
            text += char
            logprob = -0.1 * (step + 1)
            top = (TopLogprob(token_id=ord(char), text=char, logprob=logprob),) if k else ()
            stop = next((x for x in s.stop if text.endswith(x)), None)
            yield TokenEvent(index=index, token_id=ord(char), text=char,
                             logprob=logprob if k is not None else None, top_logprobs=top,
                             token_text=char if k is not None else None,
                             last=stop is not None or step == max_tokens - 1,
                             elapsed_s=0.01 * (step + 1), batch_size=len(self.active),
                             queue_s=0.002 if step == 0 else None)
            if stop is not None:
                yield self._final(index, "stop_sequence", stop, prompt_len, step + 1)
                return
        yield self._final(index, "length", None, prompt_len, max_tokens)

    @staticmethod
    def _final(index, reason, stop_reason, prompt_len, completion) -> FinalEvent:
        return FinalEvent(index=index, finish_reason=reason, stop_reason=stop_reason,
                          usage=Usage(prompt_tokens=prompt_len, completion_tokens=completion))
