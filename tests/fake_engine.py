"""A deterministic in-process engine kind for protocol unit tests and the engine contract suite.

:class:`FakeModel` is an :class:`engines.kit.base.Engine`: tokenizer one token per character (id =
code point); choice ``i`` emits the characters of ``reply`` (default "Hello world") cycling, each
with logprob ``-0.1 * (k+1)``; EOS (id 0) ends it when ``reply`` runs out, unless ``ignore_eos``;
a stop string ends the choice with ``stop_sequence``. A request with a LoRA adapter replies
``"<adapter name>: " + reply``. :class:`FakeEngine` is that model behind the
real :class:`engines.replica.host.EngineHost`, so admission, deadlines and accounting are the product's.

Controllers: with ``controllers="splice"``, a request whose controller is ``fake-splice`` gets
the edits its JSON ``arg`` asks for: ``{"ff": "ab"}`` forces those characters first,
``{"backtrack": k}`` withdraws the last ``k`` reply tokens and then appends ``"!"``,
``{"fork": m}`` forks choice 0 into ``m`` more choices (indices ``n``, ``n + 1``, ...) at the end,
``{"fail": "why"}`` fails to start (an instantiate error). It is hosted under that tag and under
``FAKE_SPLICE_ID`` (its module id, as ``ModelInfo.controllers`` reports it).

Reasoning: ``<think>`` and ``</think>`` are one token each (ids past the characters'). With
``reasoning=True`` the model reasons in vLLM's ``deepseek_r1`` format: a chat prompt ends in
``<think>`` and the reply is expected to hold ``</think>`` (``REASONING_REPLY``); a request
whose reasoning budget the host turned into the ``reasoning`` controller gets the marker after
that many tokens, then the reply's answer (what the real controller would force). A chat
prompt with ``enable_thinking: false`` (``ChatPrompt.template_kwargs``) ends in a closed think
block instead, as Qwen3's template renders it, and gets the reply's answer only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from contract import (
    BacktrackEvent,
    Capabilities,
    ChatPrompt,
    ControllerSupport,
    ControllerTag,
    ErrorEvent,
    Event,
    FinalEvent,
    ForkEvent,
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
from engines.kit.base import Admitted
from engines.replica.host import EngineHost

MAX_MODEL_LEN = 64
FAKE_SPLICE_ID = "f" * 64
MARKERS = {"<think>": 0x110000, "</think>": 0x110001}
VOCAB = 0x110002
REASONING_REPLY = "Two and two.</think>Four"


def tokens_of(text: str) -> list[int]:
    """One token per character, but one each for the reasoning markers."""
    ids: list[int] = []
    while text:
        marker = next((m for m in MARKERS if text.startswith(m)), None)
        ids.append(MARKERS[marker] if marker else ord(text[0]))
        text = text[len(marker):] if marker else text[1:]
    return ids


_MARKER_OF = {v: k for k, v in MARKERS.items()}


def text_of(ids) -> str:
    return "".join([_MARKER_OF[t] if t in _MARKER_OF else chr(t) for t in ids])


class FakeTokenizer:
    """The fake model's tokenizer, as much of Hugging Face's interface as the host reads."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return tokens_of(text)

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return text_of(ids)

    def get_vocab(self) -> dict[str, int]:
        return dict(MARKERS)


class FakeModel:
    """The fake engine kind (``engines.kit.base.Engine``)."""

    tokenizer = FakeTokenizer()

    def __init__(self, name: str, reply: str, delay: float, controllers: ControllerSupport,
                 reasoning: bool = False):
        self.name = name
        self.reasoning = reasoning
        self.reply = reply
        self.delay = delay
        self.controllers = controllers
        self.cancelled: list[str] = []

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.name, root=f"/models/{self.name}", max_model_len=MAX_MODEL_LEN,
                         vocab_size=VOCAB, eos_token_id=0, engine="fake",
                         capabilities=Capabilities(controllers=self.controllers, adapters=True),
                         controllers=() if self.controllers == "none" else (
                             ControllerTag(tag="fake-splice", module_id=FAKE_SPLICE_ID),))

    async def check_health(self) -> None:
        return None

    def render(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokenPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return tokens_of(prompt.text)
        assert isinstance(prompt, ChatPrompt)
        text = "".join(f"<{m.role}>{m.content}" for m in prompt.messages) + "<assistant>"
        if not self.reasoning:
            return tokens_of(text)
        # Qwen3's way: thinking turned off closes the think block in the prompt.
        thinks = prompt.template_kwargs.get("enable_thinking", True)
        return tokens_of(text + ("<think>" if thinks else "<think></think>"))

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return text_of(token_ids)

    async def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]:
        ids = admitted.prompt_ids
        try:
            if request.output.echo or request.output.prompt_logprobs is not None:
                yield PromptEvent(
                    text=text_of(ids),
                    tokens=tuple(PromptToken(token_id=t, text=text_of([t]),
                                             logprob=None if i == 0 else -float(i),
                                             rank=None if i == 0 else i)
                                 for i, t in enumerate(ids)),
                )
            script = {}
            if request.controller is not None and \
                    request.controller.module in ("fake-splice", FAKE_SPLICE_ID):
                script = json.loads(request.controller.arg or "{}")
                if "fail" in script:
                    yield ErrorEvent(kind="validation", param="controller",
                                     message=f"controller failed: {script['fail']}")
                    return
            answer_only = self.reasoning and bool(ids) and ids[-1] == MARKERS["</think>"]
            for index in range(request.sampling.n):
                async for event in self._choice(request, index, len(ids), admitted.max_tokens,
                                                script if index == 0 else {}, answer_only):
                    yield event
        except (asyncio.CancelledError, GeneratorExit):
            self.cancelled.append(request.request_id)
            raise

    async def _choice(self, request, index, prompt_len, max_tokens, script,
                      answer_only=False) -> AsyncIterator[Event]:
        s, k = request.sampling, request.output.logprobs
        forced = [TokenEvent(index=index, token_id=ord(c), text=c, forced=True)
                  for c in script.get("ff", "")]
        for event in forced:
            yield event
        spliced = bool(script.get("backtrack") or script.get("fork"))
        reply = self.reply if request.adapter is None else f"{request.adapter.name}: {self.reply}"
        reply = self._budgeted(request, reply)
        end = MARKERS["</think>"]
        if answer_only and end in reply:  # the prompt closed the think block
            reply = reply[reply.index(end) + 1:]
        text = ""
        steps = max_tokens - len(forced)
        for step in range(steps):
            if self.delay:
                await asyncio.sleep(self.delay)
            if step >= len(reply) and not s.ignore_eos:
                yield TokenEvent(index=index, token_id=0, text="", logprob=-0.01, special=True,
                                 last=not spliced)
                for event in self._end(request, index, "eos", None, prompt_len, step + 1, script,
                                       text):
                    yield event
                return
            token = reply[step % len(reply)]
            char = text_of([token])
            text += char
            logprob = -0.1 * (step + 1)
            top = (TopLogprob(token_id=token, text=char, logprob=logprob),) if k else ()
            stop = next((x for x in s.stop if text.endswith(x)), None)
            yield TokenEvent(index=index, token_id=token, text=char,
                             logprob=logprob if k is not None else None, top_logprobs=top,
                             token_text=char if k is not None else None,
                             last=not spliced and (stop is not None or step == steps - 1),
                             elapsed_s=0.01 * (step + 1), batch_size=1,
                             queue_s=0.002 if step == 0 else None)
            if stop is not None:
                for event in self._end(request, index, "stop_sequence", stop, prompt_len,
                                       step + 1, script, text):
                    yield event
                return
        for event in self._end(request, index, "length", None, prompt_len, steps, script, text):
            yield event

    @staticmethod
    def _budgeted(request: GenerateRequest, reply: str) -> list[int]:
        """The reply's tokens; under the ``reasoning`` controller with a budget, the thinking
        cut at the budget and the marker forced there."""
        ids = tokens_of(reply)
        if request.controller is None or request.controller.module != "reasoning":
            return ids
        budget = json.loads(request.controller.arg)["budget"]
        end = MARKERS["</think>"]
        if budget is None or end not in ids or ids.index(end) <= budget:
            return ids
        return ids[:budget] + ids[ids.index(end):]

    @staticmethod
    def _end(request, index, reason, stop_reason, prompt_len, generated, script, text
             ) -> list[Event]:
        """The scripted splices, then the final events of the choice and of its forks."""
        events: list[Event] = []
        forced = len(script.get("ff", ""))
        backtrack = script.get("backtrack", 0)
        if backtrack:
            events.append(BacktrackEvent(index=index, count=backtrack, text=text[-backtrack:]))
            events.append(TokenEvent(index=index, token_id=ord("!"), text="!"))
            generated += 1
        forks = [request.sampling.n + j for j in range(script.get("fork", 0))]
        events.extend(ForkEvent(index=fork, parent=index) for fork in forks)
        completion = forced + generated - backtrack
        usage = Usage(prompt_tokens=prompt_len, completion_tokens=completion,
                      forced_tokens=forced, sampled_tokens=generated if script else None)
        inherited = Usage(prompt_tokens=prompt_len, completion_tokens=completion, sampled_tokens=0)
        events.extend(FinalEvent(index=fork, finish_reason=reason, stop_reason=stop_reason,
                                 usage=inherited) for fork in forks)
        events.append(FinalEvent(index=index, finish_reason=reason, stop_reason=stop_reason,
                                 usage=usage))
        return events


def _deepseek_r1():
    from engines.replica.reasoning import ReasoningFormat

    return ReasoningFormat("deepseek_r1", FakeTokenizer())


class FakeEngine(EngineHost):
    """The fake kind behind the real host: what unit tests register as a model's engine.

    ``requests`` lists every request the protocols sent (admitted or not); ``cancelled`` the
    ones whose stream was cancelled or closed before it finished.
    """

    def __init__(self, name: str = "fake-model", reply: str = "Hello world", delay: float = 0.0,
                 controllers: ControllerSupport = "none", reasoning: bool = False):
        self.model = FakeModel(name, reply, delay, controllers, reasoning)
        super().__init__(self.model, reasoning=_deepseek_r1() if reasoning else None)
        self.requests: list[GenerateRequest] = []

    @property
    def cancelled(self) -> list[str]:
        return self.model.cancelled

    def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        self.requests.append(request)
        return super().generate(request)
