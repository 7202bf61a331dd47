"""The ``vllm`` engine kind over vLLM's v1 ``AsyncLLM`` (CPU build or GPU build alike).

This module owns everything vLLM-specific: prompt rendering and tokenization, the mapping of
:class:`~contract.Sampling` onto ``SamplingParams``, vLLM's own refusals, and the
reference decoder parity tests compare against. Admission, deadlines and accounting are the
host's (``engines.replica.host``); ``engines.vllm.translate`` turns outputs into events.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import TYPE_CHECKING, Any

from contract import (
    Adapter,
    Capabilities,
    ErrorEvent,
    Event,
    GenerateRequest,
    ModelInfo,
    Prompt,
)
from engines.controllers.driver.run import ControlledRun, Segment
from engines.kit.base import Admitted, ReferenceOutput
from engines.kit.config import Controllers, ModelConfig
from engines.kit.embedded import resolve_model_source
from engines.kit.lora import AdapterInvalid
from engines.kit.reaper import start_reaper
from engines.kit.tokens import prompt_char_limit, render_prompt
from engines.vllm.adapters import VLLMAdapters, lora_engine_args, needs_base_slot
from engines.vllm.args import engine_args
from engines.vllm.controller_hook import AICI_ARG
from engines.vllm.logit_bias import BIAS_ARG, VLLM_MAX_ENTRIES, pack_bias
from engines.vllm.logit_bias import PROCESSOR as BIAS_PROCESSOR
from engines.vllm.translate import Translator

if TYPE_CHECKING:
    from engines.controllers.runtime.service import AttachedRuntime

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)

# Sampling fields that SamplingParams takes under the same name and meaning.
_SAME_NAMED = ("n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty",
               "presence_penalty", "frequency_penalty", "seed", "min_tokens",
               "include_stop_str_in_output", "ignore_eos")


class VLLMEngine:
    """One vLLM ``AsyncLLM`` as an :class:`engines.kit.base.Engine` (also a ReferenceEngine)."""

    def __init__(self, config: ModelConfig):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.model_path = resolve_model_source(config.source)
        kwargs = engine_args(config.engine_args)
        base_slot = config.lora is not None and needs_base_slot()
        if config.lora is not None:  # the model's engine_args may refine vLLM's LoRA options
            kwargs = {**lora_engine_args(config.lora, base_slot), **kwargs}
        kwargs["logits_processors"] = [*(kwargs.get("logits_processors") or []), BIAS_PROCESSOR]
        self._runtime: AttachedRuntime | None = None  # the controllers' (None: off)
        if config.controllers is not None:
            kwargs = self._start_controllers(config.controllers, kwargs)
        args = AsyncEngineArgs(model=self.model_path, served_model_name=[config.name], **kwargs)
        # vLLM's EngineCore and workers will be this process's children: if it is killed they
        # would run on (GBs each), even while they still load; a reaper process ends them then
        # (engines/kit/reaper.py).
        self._reaper = start_reaper()
        # In a replica this runs inside the placement step (engines.kit.kinds.create_engine): vLLM
        # picks its worker's cores from this process's affinity, widened for it there.
        self._llm = AsyncLLM.from_engine_args(args, stat_loggers=_ray_stat_loggers())
        self.tokenizer = self._llm.get_tokenizer()
        self._special_ids = frozenset(self.tokenizer.all_special_ids)
        self._priority = self._llm.scheduler_config.policy == "priority"
        self._adapters = None if config.lora is None else \
            VLLMAdapters(self._llm, config.lora, base_slot)
        model_config = self._llm.model_config
        vocab_size = model_config.get_vocab_size()
        max_logprobs = model_config.max_logprobs
        if max_logprobs < 0:  # vLLM's "no limit"
            max_logprobs = vocab_size
        self._info = ModelInfo(
            name=config.name, root=self.model_path, max_model_len=model_config.max_model_len,
            vocab_size=vocab_size, eos_token_id=self.tokenizer.eos_token_id, engine=config.engine,
            dtype=str(model_config.dtype).removeprefix("torch."),
            capabilities=Capabilities(controllers="none" if self._runtime is None else "mask",
                                      max_logprobs=max_logprobs,
                                      max_prompt_logprobs=max_logprobs,
                                      best_of_above_n=False, priority=self._priority,
                                      adapters=self._adapters is not None),
            controllers=self._runtime.tags() if self._runtime is not None else (),
            max_prompt_chars=prompt_char_limit(self.tokenizer, model_config.max_model_len),
        )

    def _start_controllers(self, options: Controllers, kwargs: dict[str, Any]) -> dict[str, Any]:
        """The shm objects, the runtime beside this replica, and the hook in vLLM's args."""
        from transformers import AutoConfig

        from engines.controllers.runtime.runtime import Limits
        from engines.controllers.runtime.service import attach_runtime

        if int(kwargs.get("tensor_parallel_size") or 1) > 1 or \
                int(kwargs.get("pipeline_parallel_size") or 1) > 1:
            # Every worker would run the hook and step the controllers once each.
            raise ValueError(f"model {self.config.name!r}: controllers need one vLLM worker "
                             "(tensor/pipeline parallel size 1); set controllers: null")
        if kwargs.get("async_scheduling"):
            raise ValueError(f"model {self.config.name!r}: controllers need async_scheduling "
                             "off (the hook reads each step's tokens before the forward pass)")
        vocab = int(AutoConfig.from_pretrained(self.model_path).vocab_size)
        limits = Limits(step_s=options.step_ms / 1000, init_s=options.init_ms / 1000)
        attached = attach_runtime(self.config.name, self.model_path, vocab, options.custom, limits)
        self._runtime = attached
        weakref.finalize(self, attached.close)
        prefix = attached.prefix
        processors = list(kwargs.get("logits_processors") or [])
        extra = dict(kwargs.get("additional_config") or {})
        extra["aici_prefix"] = prefix
        hook = "engines.vllm.controller_hook:ControllerLogitsProcessor"
        # Async scheduling (vLLM's default on GPUs; off on CPU) schedules a step before the
        # last one's tokens are known: a finished segment's row could then report its stop
        # token to the controller after the driver has taken the controller back.
        return {"async_scheduling": False, **kwargs, "additional_config": extra,
                "logits_processors": [*processors, hook]}

    def model_info(self) -> ModelInfo:
        return self._info

    async def check_health(self) -> None:
        await self._llm.check_health()

    def render(self, prompt: Prompt) -> list[int]:
        return render_prompt(self.tokenizer, prompt)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(token_ids))

    async def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]:
        if request.controller is not None and self._runtime is not None:
            def segment(ids: list[int], max_tokens: int, binding: dict,
                        seg: Segment) -> AsyncIterator[Event]:
                return self._generate(request, ids, max_tokens, binding, seg)

            run = ControlledRun(request, admitted.prompt_ids, admitted.max_tokens,
                                self._runtime.side,
                                self.tokenizer, self.tokenizer.eos_token_id, segment)
            async with aclosing(run.stream()) as events:
                async for event in events:
                    yield event
            return
        async for event in self._generate(request, admitted.prompt_ids, admitted.max_tokens):
            yield event

    async def _generate(self, request: GenerateRequest, prompt_ids: list[int], max_tokens: int,
                        binding: dict | None = None,
                        segment: Segment | None = None) -> AsyncIterator[Event]:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError
        from vllm.inputs import tokens_input

        try:
            params = self._sampling_params(request, max_tokens, binding)
        except Exception as exc:  # vLLM's range checks (VLLMValidationError, ValueError)
            yield ErrorEvent(kind="validation", message=str(exc))
            return
        lora = None
        if self._adapters is not None:  # (an adapter on a model without: admission refused it)
            try:
                lora = await self._adapters.request_for(request.adapter)
            except AdapterInvalid as exc:
                yield ErrorEvent(kind="validation", message=str(exc), param="model")
                return
        request_id = request.request_id if binding is None else \
            f"{request.request_id}-s{binding['seq']}"
        # Already tokenized (render): handed to vLLM as a rendered input, which it checks
        # (length, vocabulary) on this loop. A bare {"prompt_token_ids": ...} is a raw prompt
        # that vLLM renders again on a thread of its pool: a thread hop per request for no
        # work (docs/results/benchmarks-2026-12-07.md, "Placement on a fast engine, and a
        # request's own cost in the replica").
        outputs = self._llm.generate(tokens_input(prompt_ids), params, request_id,
                                     lora_request=lora,
                                     priority=request.priority if self._priority else 0)
        translator = Translator(request, prompt_ids, self._special_ids, self.tokenizer,
                                batch_size=self._llm.get_num_unfinished_requests)
        finished = False
        try:
            async with aclosing(outputs):  # vLLM's generator is closed now, not when collected
                async for output in outputs:
                    if segment is not None and output.outputs:
                        choice = output.outputs[0]
                        if choice.finish_reason is not None:
                            segment.finish = choice.finish_reason
                            segment.stop_reason = choice.stop_reason
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

    def _sampling_params(self, request: GenerateRequest, max_tokens: int,
                         binding: dict | None = None):
        """``binding``: a segment of a controlled run. EOS then ends the segment but not by
        the model's own rule (``ignore_eos``): it comes first among the stop ids, where the
        hook finds the token it forces to end a segment."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s, out = request.sampling, request.output
        same = {name: getattr(s, name) for name in _SAME_NAMED}
        stop_ids, extra, bias = list(s.stop_token_ids), {}, dict(s.logit_bias)
        if binding is not None:
            eos = self.tokenizer.eos_token_id
            stop_ids = [eos] + [t for t in stop_ids if t != eos]
            same["ignore_eos"] = True
            extra[AICI_ARG] = binding
        if len(bias) > VLLM_MAX_ENTRIES:  # beyond what vLLM takes: our processor applies it
            extra[BIAS_ARG], bias = pack_bias(bias), {}
        return SamplingParams(
            **same,
            extra_args=extra or None,
            max_tokens=max_tokens,
            stop=list(s.stop) or None,
            stop_token_ids=stop_ids or None,
            logit_bias=bias or None,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
            skip_special_tokens=out.skip_special_tokens,
            spaces_between_special_tokens=out.spaces_between_special_tokens,
            output_kind=RequestOutputKind.DELTA,
        )

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int,
                               adapter: Adapter | None = None) -> ReferenceOutput:
        """Greedy completion through vLLM's own API only (vLLM tokenizes text, vLLM's defaults;
        an adapter as vLLM's own ``LoRARequest`` of a fresh id): bypasses every gateway
        translation."""
        from vllm import SamplingParams
        from vllm.lora.request import LoRARequest

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        native_prompt: Any = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        lora = None if adapter is None else \
            LoRARequest(f"reference-{adapter.name}", next(_REFERENCE_LORA_IDS), adapter.path)
        final = None
        async for output in self._llm.generate(native_prompt, params,
                                               f"reference-{time.monotonic_ns()}",
                                               lora_request=lora):
            final = output
        assert final is not None
        choice = final.outputs[0]
        return ReferenceOutput(
            text=choice.text, token_ids=list(choice.token_ids),
            logprobs=[step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids,
                                                         strict=True)],
            prompt_token_ids=list(final.prompt_token_ids))


# The oracle's adapter ids: apart from the ids requests' adapters get (VLLMAdapters counts up
# from 1), and new each call, so the oracle never reuses weights loaded before.
_REFERENCE_LORA_IDS = itertools.count(1 << 30)


def _ray_stat_loggers() -> list | None:
    """In a Ray worker, vLLM's own figures through Ray's metrics system, so that every replica
    is exported (docs/observability.md): sampled, not vLLM's per-token Ray logger
    (engines/vllm/stats.py says what that cost)."""
    try:
        import ray
    except ImportError:  # vLLM without Ray
        return None
    if not ray.is_initialized():
        return None
    from engines.vllm.stats import SampledStats

    return [SampledStats]
