"""The ``pipeline`` engine kind: the origin of a layer-split model, as an engine contract.

The replica holds the tokenizer, the embedding, the first ``origin_layers`` layers, the final
norm, the head and the sampler; stage actors hold the other layers (``RayStages``). Every
protocol works on it unchanged because it yields the same events as any kind. Each choice is
its own sequence in the pipe (``choice.Choice``); up to ``max_sequences`` run at once, batched
into micro-batches by the origin's scheduler (``origin.Origin``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from typing import Any

from contract import (
    Adapter,
    Capabilities,
    ErrorEvent,
    Event,
    FinalEvent,
    GenerateRequest,
    ModelInfo,
    Prompt,
    PromptEvent,
    PromptToken,
    TopLogprob,
)
from contract.pump import Pump
from engines.controllers.driver.run import ControlledRun, Segment
from engines.kit.base import Admitted, ReferenceOutput
from engines.kit.config import ModelConfig
from engines.kit.embedded import resolve_model_source
from engines.kit.tokens import prompt_char_limit, render_prompt
from engines.pipeline.budget import BudgetFull, KVBudget, NeverFits, tokens_for
from engines.pipeline.choice import Choice
from engines.pipeline.config import PipelineArgs, check_model_type, parse_args, plan_stages
from engines.pipeline.controlled import SegmentRow, StepHook, note_finish, segment_request
from engines.pipeline.jobs import Job, PipelineFailure
from engines.pipeline.origin import Origin
from engines.pipeline.stages import RayStages, Stages

__all__ = ["PipelineEngine"]

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20
MAX_N = 16


class PipelineEngine:
    """An :class:`engines.kit.base.Engine` (and ReferenceEngine: the unsplit HF model)."""

    def __init__(self, config: ModelConfig, stages: Stages | None = None):
        import torch
        from transformers import AutoTokenizer

        from engines.pipeline.kernels import packs
        from engines.pipeline.loading import load_config, load_origin, text_config

        self.config = config
        self.args: PipelineArgs = parse_args(config.engine_args)
        self.model_path = resolve_model_source(config.source)
        hf_config = load_config(self.model_path)
        tcfg = text_config(hf_config)
        check_model_type(tcfg.model_type)
        self.ranges = plan_stages(self.args, tcfg.num_hidden_layers)
        self.dtype = getattr(torch, self.args.dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        parts = load_origin(self.model_path, self.args.origin_layers, self.dtype,
                            self.args.attn_implementation, hf_config).to(self.args.device)
        if packs(self.args.cpu_kernels, self.args.device, self.dtype):
            parts.pack()
        self.stages = stages or RayStages(self.model_path, self.ranges, self.args,
                                          label=f"{config.name}")
        vocab_size = parts.vocab_size
        self._controllers, self._hook = self._start_controllers(vocab_size)
        self.origin = Origin(parts, self.args.origin_layers, self.stages,
                             prefill_chunk=self.args.prefill_chunk,
                             max_restarts=self.args.max_restarts, check_digest=self.args.digest,
                             device=self.args.device, threads=self.args.origin_threads,
                             step_timeout_s=self.args.step_timeout_s,
                             max_batch_tokens=self.args.max_batch_tokens,
                             batches_in_flight=self.args.batches_in_flight,
                             before_steps=self._hook.ask if self._hook is not None else None,
                             model=config.name)
        self.eos_ids = _eos_ids(self.model_path, self.tokenizer)
        self.special_ids = frozenset(self.tokenizer.all_special_ids)
        limit = self.args.max_model_len or min(tcfg.max_position_embeddings, 4096)
        self._info = ModelInfo(
            name=config.name, root=self.model_path, max_model_len=limit, vocab_size=vocab_size,
            eos_token_id=self.tokenizer.eos_token_id, engine=config.engine, dtype=self.args.dtype,
            capabilities=Capabilities(controllers="none" if self._hook is None else "mask",
                                      max_logprobs=MAX_LOGPROBS,
                                      max_prompt_logprobs=MAX_LOGPROBS, max_n=MAX_N,
                                      best_of_above_n=False, priority=False),
            controllers=self._controllers.tags() if self._controllers is not None else (),
            max_prompt_chars=prompt_char_limit(self.tokenizer, limit))
        self._slots = asyncio.Semaphore(self.args.max_sequences)
        widest = max([self.args.origin_layers] + [end - start for start, end in self.ranges])
        self.kv_budget = KVBudget(tokens_for(self.args.kv_cache_gib, tcfg, widest,
                                             self.dtype.itemsize), self.args.max_sequences)
        self.live = 0  # sequences in the pipe now
        self._reference = None

    def _start_controllers(self, vocab_size: int) -> tuple[Any, StepHook | None]:
        """The controller runtime beside this replica and the origin's hook into it."""
        options = self.config.controllers
        if options is None:
            return None, None
        from engines.controllers.runtime.runtime import Limits
        from engines.controllers.runtime.service import attach_runtime, close_quietly

        limits = Limits(step_s=options.step_ms / 1000, init_s=options.init_ms / 1000)
        attached = attach_runtime(self.config.name, self.model_path, vocab_size, options.custom,
                                  limits)
        try:
            hook = StepHook(attached.prefix, vocab_size, self.tokenizer.eos_token_id)
        except BaseException:
            attached.close()
            raise
        weakref.finalize(self, close_quietly, hook, attached)
        return attached, hook

    # --- Engine -----------------------------------------------------------------------

    def model_info(self) -> ModelInfo:
        return self._info

    async def check_health(self) -> None:
        await self.stages.check(busy=self.live > 0)

    def render(self, prompt: Prompt) -> list[int]:
        return render_prompt(self.tokenizer, prompt)

    def detokenize(self, token_ids: tuple[int, ...]) -> str:
        return self.tokenizer.decode(list(token_ids))

    async def stream(self, request: GenerateRequest, admitted: Admitted) -> AsyncIterator[Event]:
        if request.controller is not None and self._controllers is not None:
            run = ControlledRun(request, admitted.prompt_ids, admitted.max_tokens,
                                self._controllers.side, self.tokenizer,
                                self.tokenizer.eos_token_id,
                                functools.partial(self._segment, request))
            async with contextlib.aclosing(run.stream()) as events:
                async for event in events:
                    yield event
            return
        started = time.monotonic()
        n = request.sampling.n
        try:
            async with self.kv_budget.reserve(n * (len(admitted.prompt_ids) +
                                                   admitted.max_tokens)):
                events = self._choices(request, admitted, started)
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield event
        except NeverFits as exc:
            yield ErrorEvent(kind="validation", message=str(exc), param="max_tokens")
        except BudgetFull as exc:
            yield ErrorEvent(kind="overloaded", message=f"{exc}; retry later")

    async def _choices(self, request: GenerateRequest, admitted: Admitted,
                       started: float) -> AsyncIterator[Event]:
        n = request.sampling.n
        if n == 1:
            gen = self._choice(request, admitted, 0, started, None)
            async with contextlib.aclosing(gen):
                async for event in gen:
                    yield event
            return
        # n > 1: one task per choice into a bounded queue; choice 0 goes first with the prompt
        # event, the others start once it is out (the contract puts it before every token).
        prompt_out = asyncio.Event()

        async def choice(index: int) -> AsyncIterator[Event]:
            try:
                if index:
                    await prompt_out.wait()
                events = self._choice(request, admitted, index, started, prompt_out)
                async with contextlib.aclosing(events):
                    async for event in events:
                        yield event
            finally:
                prompt_out.set()

        async with Pump[Event](64) as pump:
            for index in range(n):
                pump.start(choice(index))
            async for event in pump.items():
                yield event
                if isinstance(event, ErrorEvent):
                    return

    async def _segment(self, request: GenerateRequest, ids: list[int], max_tokens: int,
                       binding: dict, segment: Segment) -> AsyncIterator[Event]:
        """One segment of a controlled request: a sequence from ``ids`` whose every step the
        hook masks (engines/pipeline/controlled.py); how it ended goes into ``segment``."""
        assert self._hook is not None
        row = SegmentRow(binding["seq"], binding["req_id"], reported=len(ids))
        admitted = Admitted(prompt_ids=list(ids), max_tokens=max_tokens)
        try:
            async with self.kv_budget.reserve(len(ids) + max_tokens):
                events = self._choice(segment_request(request, self.tokenizer.eos_token_id,
                                                      row.seq),
                                      admitted, 0, time.monotonic(), None, row)
                async with contextlib.aclosing(events):
                    async for event in events:
                        if isinstance(event, FinalEvent):
                            note_finish(segment, event)
                        yield event
        except NeverFits as exc:
            yield ErrorEvent(kind="validation", message=str(exc), param="max_tokens")
        except BudgetFull as exc:
            yield ErrorEvent(kind="overloaded", message=f"{exc}; retry later")

    # --- one choice ---------------------------------------------------------------------

    async def _choice(self, request: GenerateRequest, admitted: Admitted, index: int,
                      started: float, prompt_out: asyncio.Event | None,
                      row: SegmentRow | None = None) -> AsyncIterator[Event]:
        out = request.output
        want_prompt = index == 0 and (out.echo or out.prompt_logprobs is not None)
        waiting = time.monotonic()
        async with self._slots:
            control = None if row is None or self._hook is None else \
                functools.partial(self._hook.mask, row)
            choice = Choice(self, request, admitted, index, started, time.monotonic() - waiting,
                            control)
            self.live += 1
            try:  # the origin frees the caches however this ends (a disconnect, a deadline)
                steps = self.origin.generate(Job(choice.seq, choice.step, every=want_prompt,
                                                 control=row))
                async with contextlib.aclosing(steps):
                    async for events in steps:
                        for event in events:
                            yield event
                        if prompt_out is not None:
                            prompt_out.set()
            except PipelineFailure as exc:
                log.error("%s: %s", choice.seq.seq_id, exc)
                yield ErrorEvent(kind="engine", message=str(exc))
            finally:
                self.live -= 1

    def prompt_event(self, prompt_ids: list[int], hidden_chunks: list[Any],
                      k: int | None) -> PromptEvent:
        """Per prompt position: the logprob of that token given the ones before (none for the
        first), and the top ``k`` alternatives; computed chunk by chunk to bound memory."""
        import torch

        tokens: list[PromptToken] = [PromptToken(token_id=prompt_ids[0],
                                                 text=self.tokenizer.decode([prompt_ids[0]]))]
        position = 0
        for hidden in hidden_chunks:
            logprobs = torch.log_softmax(self.origin.logits(hidden), dim=-1)
            for row in logprobs:
                position += 1
                if position >= len(prompt_ids):
                    break
                token = prompt_ids[position]
                top: tuple[TopLogprob, ...] = ()
                if k:
                    values, ids = torch.topk(row, k)
                    top = tuple(TopLogprob(token_id=int(i), text=self.tokenizer.decode([int(i)]),
                                           logprob=float(v)) for i, v in zip(ids, values,
                                                                             strict=True))
                scored = k is not None  # (rank: ties count against it, as vLLM's)
                tokens.append(PromptToken(token_id=token, text=self.tokenizer.decode([token]),
                                          logprob=float(row[token]) if scored else None,
                                          top_logprobs=top,
                                          rank=int((row >= row[token]).sum()) if scored
                                          else None))
        return PromptEvent(text=self.tokenizer.decode(prompt_ids), tokens=tuple(tokens))

    # --- oracle ---------------------------------------------------------------------------

    async def reference_greedy(self, prompt: str | list[int], max_tokens: int,
                               adapter: Adapter | None = None) -> ReferenceOutput:
        """Greedy decoding by the unsplit HF model (``generate(do_sample=False)``), loaded on
        first use: the independent oracle of parity tests. No adapters (the kind serves
        none)."""
        if adapter is not None:
            raise NotImplementedError("the pipeline engine serves no LoRA adapters")
        return await self.origin.run(self._reference_greedy, prompt, max_tokens)

    def _reference_greedy(self, prompt: str | list[int], max_tokens: int) -> ReferenceOutput:
        import torch
        from transformers import AutoModelForCausalLM

        if self._reference is None:
            self._reference = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=self.dtype,
                attn_implementation=self.args.attn_implementation).to(self.args.device).eval()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        with torch.inference_mode():
            out = self._reference.generate(
                torch.tensor([ids], device=self.args.device), max_new_tokens=max_tokens,
                do_sample=False,
                output_logits=True, return_dict_in_generate=True,
                eos_token_id=sorted(self.eos_ids), pad_token_id=self.tokenizer.eos_token_id,
                temperature=None, top_p=None, top_k=None)
        generated = out.sequences[0, len(ids):].tolist()
        logprobs = [float(torch.log_softmax(step[0].float(), -1)[t])
                    for step, t in zip(out.logits, generated, strict=False)]
        return ReferenceOutput(text=self.tokenizer.decode(generated, skip_special_tokens=True),
                               token_ids=generated, logprobs=logprobs, prompt_token_ids=ids)


def _eos_ids(model_path: str, tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS plus the generation config's (as vLLM stops on both)."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        from transformers import GenerationConfig

        extra = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids |= set(extra if isinstance(extra, list) else [extra] if extra is not None else [])
    except OSError:  # no generation_config.json
        pass
    return frozenset(ids)

