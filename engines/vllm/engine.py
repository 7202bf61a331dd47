"""The ``vllm`` engine kind over vLLM's v1 ``AsyncLLM`` (CPU build or GPU build alike).

This module owns everything vLLM-specific: prompt rendering and tokenization, the mapping of
:class:`~protocols.internal.Sampling` onto ``SamplingParams``, vLLM's own refusals, and the
reference decoder parity tests compare against. Admission, deadlines and accounting are the
host's (``engines.host``); ``engines.vllm.translate`` turns outputs into events.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from engines.base import Admitted, ReferenceOutput
from engines.config import ModelConfig
from engines.embedded import resolve_model_source
from engines.tokens import render_prompt
from engines.vllm.args import engine_args
from engines.vllm.translate import Translator
from protocols.internal import (
    Capabilities,
    ErrorEvent,
    Event,
    GenerateRequest,
    ModelInfo,
    Prompt,
)

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)

# Sampling fields that SamplingParams takes under the same name and meaning.
_SAME_NAMED = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "seed", "min_tokens",
               "include_stop_str_in_output", "ignore_eos")


class VLLMEngine:
    """One vLLM ``AsyncLLM`` as an :class:`engines.base.Engine` (also a ReferenceEngine)."""

    def __init__(self, config: ModelConfig):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.model_path = resolve_model_source(config.source)
        args = AsyncEngineArgs(model=self.model_path, served_model_name=[config.name],
                               **engine_args(config.engine_args))
        self._llm = AsyncLLM.from_engine_args(args)
        self._tokenizer = self._llm.get_tokenizer()
        self._special_ids = frozenset(self._tokenizer.all_special_ids)
        self._priority = self._llm.scheduler_config.policy == "priority"
        model_config = self._llm.model_config
        vocab_size = model_config.get_vocab_size()
        max_logprobs = model_config.max_logprobs
        if max_logprobs < 0:  # vLLM's "no limit"
            max_logprobs = vocab_size
        self._info = ModelInfo(
            name=config.name, root=self.model_path, max_model_len=model_config.max_model_len,
            vocab_size=vocab_size, eos_token_id=self._tokenizer.eos_token_id, engine=config.engine,
            dtype=str(model_config.dtype).removeprefix("torch."),
            capabilities=Capabilities(controllers="none", max_logprobs=max_logprobs,
                                      max_prompt_logprobs=max_logprobs,
                                      best_of_above_n=False, priority=self._priority),
        )

    def model_info(self) -> ModelInfo:
        return self._info

    async def check_health(self) -> None:
        await self._llm.check_health()

    def render(self, prompt: Prompt) -> list[int]:
        return render_prompt(self._tokenizer, prompt)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self._tokenizer.decode(list(token_ids))

    async def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError

        try:
            params = self._sampling_params(request, admitted.max_tokens)
        except Exception as exc:  # vLLM's range checks (VLLMValidationError, ValueError)
            yield ErrorEvent(kind="validation", message=str(exc))
            return
        request_id = request.request_id
        outputs = self._llm.generate({"prompt_token_ids": admitted.prompt_ids}, params,
                                     request_id, priority=request.priority if self._priority else 0)
        translator = Translator(request, admitted.prompt_ids, self._special_ids, self._tokenizer,
                                batch_size=self._llm.get_num_unfinished_requests)
        finished = False
        try:
            async with aclosing(outputs):  # vLLM's generator is closed now, not when collected
                async for output in outputs:
                    for event in translator.feed(output):
                        yield event
            finished = True
        except (ValueError, VLLMClientError) as exc:  # vLLM's own admission checks
            yield ErrorEvent(kind="validation", message=str(exc))
            finished = True
        except GracefulHTTPError as exc:  # queue limits: the client may retry later
            yield ErrorEvent(kind="overloaded", message=str(exc))
            finished = True
        finally:
            if not finished:  # closed, cancelled (deadline, disconnect) or failed
                await self._llm.abort(request_id)

    def _sampling_params(self, request: GenerateRequest, max_tokens: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s, out = request.sampling, request.output
        return SamplingParams(
            **{name: getattr(s, name) for name in _SAME_NAMED},
            max_tokens=max_tokens,
            stop=list(s.stop) or None,
            stop_token_ids=list(s.stop_token_ids) or None,
            logit_bias=dict(s.logit_bias) or None,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA,
        )

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int) -> ReferenceOutput:
        """Greedy completion through vLLM's own API only (vLLM tokenizes text, vLLM's defaults):
        bypasses every gateway translation."""
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        native_prompt: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        final = None
        async for output in self._llm.generate(native_prompt, params,
                                               f"reference-{time.monotonic_ns()}"):
            final = output
        assert final is not None
        choice = final.outputs[0]
        return ReferenceOutput(
            text=choice.text, token_ids=list(choice.token_ids),
            logprobs=[step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids,
                                                         strict=True)],
            prompt_token_ids=list(final.prompt_token_ids))
