"""Step 1 of docs/extending.md "Add an engine kind": a toy kind that imports the contract and
the engines' kit only. Its model answers each prompt with the prompt's characters reversed,
one token per character (id = code point), then EOS (id 0); being deterministic, each token's
logprob is 0."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from contract import (
    Capabilities,
    ChatPrompt,
    Event,
    FinalEvent,
    GenerateRequest,
    ModelInfo,
    Prompt,
    TextPrompt,
    TokenEvent,
    Usage,
)
from engines.kit.base import Admitted, PromptError
from engines.kit.config import ModelConfig


class CharTokenizer:
    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return "".join(chr(i) for i in ids if i)

    def get_vocab(self) -> dict[str, int]:
        return {}


class ToyEngine:
    def __init__(self, config: ModelConfig):
        self.name = config.name
        self.tokenizer = CharTokenizer()
        self.step_s = float(config.engine_args.get("step_s", 0.0))

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.name, root=self.name, max_model_len=256, vocab_size=0x110000,
                         eos_token_id=0, engine="toy",
                         capabilities=Capabilities(max_logprobs=0, max_prompt_logprobs=None,
                                                   max_n=1))

    def render(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            text = "\n".join(m.content for m in prompt.messages)
        elif isinstance(prompt, TextPrompt):
            text = prompt.text
        else:
            return list(prompt.token_ids)
        if "\0" in text:
            raise PromptError("NUL in prompt")
        return self.tokenizer.encode(text)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(token_ids)

    async def check_health(self) -> None:
        return None

    async def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]:
        reply = [*reversed(admitted.prompt_ids), 0]
        count = 0
        for count, token in enumerate(reply[:admitted.max_tokens], start=1):
            await asyncio.sleep(self.step_s)
            last = count == min(len(reply), admitted.max_tokens)
            yield TokenEvent(token_id=token, text=self.tokenizer.decode([token]), last=last,
                             special=token == 0, logprob=0.0)
        reason = "eos" if reply[count - 1] == 0 else "length"
        yield FinalEvent(finish_reason=reason, usage=Usage(
            prompt_tokens=len(admitted.prompt_ids), completion_tokens=count))
