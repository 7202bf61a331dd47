"""The engine contract implemented over vLLM's v1 ``AsyncLLM`` (CPU build or GPU build alike).

This module owns everything vLLM-specific: prompt rendering and tokenization, the mapping of
:class:`~protocols.internal.Sampling` onto ``SamplingParams``, and the translation of
``RequestOutput`` deltas into the internal event stream (one :class:`TokenEvent` per token).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from engines.config import ModelConfig
from engines.embedded import resolve_model_source
from protocols.internal import (
    ChatPrompt,
    ErrorEvent,
    Event,
    FinalEvent,
    FinishReason,
    GenerateRequest,
    ModelInfo,
    Prompt,
    PromptEvent,
    PromptToken,
    TextPrompt,
    Timings,
    TokenEvent,
    TokenPrompt,
    TopLogprob,
    Usage,
)

__all__ = ["VLLMEngine"]

log = logging.getLogger(__name__)


class _Invalid(ValueError):
    """A request the engine refuses; becomes a ``validation`` ErrorEvent."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class VLLMEngine:
    """One vLLM ``AsyncLLM`` behind the engine contract (:class:`protocols.internal.EngineClient`)."""

    def __init__(self, config: ModelConfig):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self.config = config
        self.model_path = resolve_model_source(config.source)
        args = AsyncEngineArgs(
            model=self.model_path, served_model_name=[config.name], **config.merged_engine_args()
        )
        self._llm = AsyncLLM.from_engine_args(args)
        self._tokenizer = self._llm.get_tokenizer()
        model_config = self._llm.model_config
        self._max_model_len = model_config.max_model_len
        self._vocab_size = model_config.get_vocab_size()
        self._max_logprobs = model_config.max_logprobs
        self._priority_enabled = self._llm.scheduler_config.policy == "priority"
        self._special_ids = frozenset(self._tokenizer.all_special_ids)
        self.active: set[str] = set()  # request ids in flight, for health/metrics/tests
        self.aborted = 0  # requests cancelled before they finished (disconnects, deadlines)

    # --- contract -----------------------------------------------------------------------

    async def model_info(self) -> ModelInfo:
        return ModelInfo(
            name=self.config.name,
            root=self.model_path,
            max_model_len=self._max_model_len,
            vocab_size=self._vocab_size,
            eos_token_id=self._tokenizer.eos_token_id,
        )

    async def check_health(self) -> None:
        await self._llm.check_health()

    async def tokenize(self, prompt: Prompt) -> tuple[int, ...]:
        """Token ids of ``prompt`` exactly as ``generate`` would see them (no validation)."""
        return tuple(self._render(prompt))

    async def detokenize(self, token_ids: tuple[int, ...]) -> str:
        """Text of ``token_ids``; ids outside the vocabulary are the caller's to reject."""
        return self._tokenizer.decode(list(token_ids))

    async def generate_native(self, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
        """Greedy completion through vLLM's own API only (vLLM tokenizes text, vLLM's defaults).

        Bypasses every gateway translation; parity checks compare protocol output against it.
        """
        from vllm import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=0)
        native_prompt = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        final = None
        request_id = f"native-{time.monotonic_ns()}"
        async for output in self._llm.generate(native_prompt, params, request_id):
            final = output
        choice = final.outputs[0]
        return {"text": choice.text, "token_ids": list(choice.token_ids),
                "logprobs": [step[t].logprob for step, t in zip(choice.logprobs, choice.token_ids,
                                                                 strict=True)],
                "prompt_token_ids": list(final.prompt_token_ids)}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Event]:
        from vllm.exceptions import GracefulHTTPError, VLLMClientError

        try:
            if request.controller is not None:
                raise _Invalid("controllers are not supported by this engine yet", "controller")
            prompt_ids = self._prompt_ids(request.prompt)
            params = self._sampling_params(request, len(prompt_ids))
        except _Invalid as exc:
            yield ErrorEvent(kind="validation", message=str(exc), param=exc.param)
            return
        except Exception as exc:  # the tokenizer or chat template refused this prompt
            yield ErrorEvent(kind="validation", message=f"invalid prompt: {exc}", param="prompt")
            return
        priority = request.priority if self._priority_enabled else 0
        stream = self._llm.generate(
            {"prompt_token_ids": prompt_ids},
            params,
            request.request_id,
            priority=priority,
        )
        self.active.add(request.request_id)
        translator = _Translator(request, prompt_ids, self._special_ids, self._tokenizer,
                                 batch_size=lambda: len(self.active))
        finished = False
        try:
            async with asyncio.timeout(request.timeout_s):
                async for output in stream:
                    for event in translator.feed(output):
                        yield event
            finished = True
        except TimeoutError:
            # The cancelled generator already aborted the vLLM request.
            for event in translator.close("abort", stop_reason="timeout"):
                yield event
            finished = True
        except (ValueError, VLLMClientError) as exc:  # vLLM's own admission checks
            yield ErrorEvent(kind="validation", message=str(exc))
            finished = True
        except GracefulHTTPError as exc:  # queue limits: the client may retry later
            yield ErrorEvent(kind="overloaded", message=str(exc))
            finished = True
        except Exception as exc:  # EngineDeadError and friends: the stream must still end
            log.exception("engine failure on %s", request.request_id)
            yield ErrorEvent(kind="engine", message=f"engine failure: {exc}")
            finished = True
        finally:
            self.active.discard(request.request_id)
            if not finished:
                self.aborted += 1
                await self._llm.abort(request.request_id)

    # --- request translation -----------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokenPrompt):
            self._check_ids(prompt.token_ids, "prompt")
        ids = self._render(prompt)
        if not ids:
            raise _Invalid("prompt is empty", "prompt")
        if len(ids) >= self._max_model_len:
            raise _Invalid(
                f"prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self._max_model_len} tokens including at least one generated token",
                "prompt",
            )
        return ids

    def _render(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, TokenPrompt):
            return list(prompt.token_ids)
        if isinstance(prompt, TextPrompt):
            return self._tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens)
        if isinstance(prompt, ChatPrompt):
            text = self._tokenizer.apply_chat_template(
                [{"role": m.role, "content": m.content} for m in prompt.messages],
                add_generation_prompt=prompt.add_generation_prompt,
                continue_final_message=prompt.continue_final_message,
                tokenize=False,
            )
            return self._tokenizer.encode(text, add_special_tokens=False)
        raise _Invalid(f"unsupported prompt type {type(prompt).__name__}")

    def _check_ids(self, ids, param: str) -> None:
        for token in ids:
            if not isinstance(token, int) or not 0 <= token < self._vocab_size:
                raise _Invalid(
                    f"token id {token!r} is outside the vocabulary [0, {self._vocab_size})", param
                )

    def _sampling_params(self, request: GenerateRequest, prompt_len: int):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        s, out = request.sampling, request.output
        room = self._max_model_len - prompt_len
        max_tokens = room if s.max_tokens is None else s.max_tokens
        if max_tokens < 1:
            raise _Invalid("max_tokens must be at least 1", "max_tokens")
        if max_tokens > room:
            raise _Invalid(
                f"this model's maximum context length is {self._max_model_len} tokens; the prompt "
                f"has {prompt_len} and {max_tokens} were requested for the completion",
                "max_tokens",
            )
        if s.best_of is not None and s.best_of > s.n:
            raise _Invalid("best_of > n is not supported by the vLLM v1 engine", "best_of")
        for k, name in ((out.logprobs, "logprobs"), (out.prompt_logprobs, "prompt_logprobs")):
            if k is not None and not 0 <= k <= self._max_logprobs:
                raise _Invalid(f"{name} must be in [0, {self._max_logprobs}]", name)
        self._check_ids(s.logit_bias, "logit_bias")
        self._check_ids(s.stop_token_ids, "stop_token_ids")
        prompt_logprobs = out.prompt_logprobs
        try:
            return SamplingParams(
                n=s.n,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=s.top_k,
                min_p=s.min_p,
                repetition_penalty=s.repetition_penalty,
                presence_penalty=s.presence_penalty,
                frequency_penalty=s.frequency_penalty,
                seed=s.seed,
                max_tokens=max_tokens,
                min_tokens=s.min_tokens,
                stop=list(s.stop) or None,
                stop_token_ids=list(s.stop_token_ids) or None,
                include_stop_str_in_output=s.include_stop_str_in_output,
                ignore_eos=s.ignore_eos,
                logit_bias=dict(s.logit_bias) or None,
                logprobs=out.logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=out.skip_special_tokens,
                spaces_between_special_tokens=out.spaces_between_special_tokens,
                output_kind=RequestOutputKind.DELTA,
            )
        except Exception as exc:  # vLLM's range checks (VLLMValidationError, ValueError)
            raise _Invalid(str(exc)) from exc


class _Translator:
    """Turns one request's ``RequestOutput`` deltas into internal events."""

    def __init__(self, request: GenerateRequest, prompt_ids, special_ids, tokenizer, batch_size):
        self.request = request
        self.batch_size = batch_size
        self.prompt_ids = prompt_ids
        self.special_ids = special_ids
        self.tokenizer = tokenizer
        self.want_prompt = request.output.echo or request.output.prompt_logprobs is not None
        self.counts: dict[int, int] = {}
        # Per choice: [ids, prefix_offset, read_offset] for incremental detokenization
        # (TokenEvent.piece), when the protocol asked for per-token text.
        self.pieces: dict[int, list] | None = {} if request.output.token_pieces else None
        self.open: set[int] = set(range(request.sampling.n))
        self.started = time.monotonic()

    def feed(self, output) -> list[Event]:
        events: list[Event] = []
        if self.want_prompt:
            self.want_prompt = False
            events.append(self._prompt_event(output))
        for choice in output.outputs:
            events.extend(self._tokens(choice, output.metrics))
            if choice.finish_reason is not None and choice.index in self.open:
                events.append(self._final(choice.index, choice.finish_reason, choice.stop_reason,
                                          output.metrics))
        return events

    def close(self, reason: FinishReason, stop_reason: str | None = None) -> list[Event]:
        """End every still-open choice (deadline expired)."""
        return [self._final(i, reason, stop_reason, None) for i in sorted(self.open)]

    def _prompt_event(self, output) -> PromptEvent:
        ids = output.prompt_token_ids or self.prompt_ids
        logprobs = output.prompt_logprobs or [None] * len(ids)
        tokens = []
        for token_id, entry in zip(ids, logprobs, strict=False):
            chosen = entry.get(token_id) if entry else None
            tokens.append(
                PromptToken(
                    token_id=token_id,
                    text=chosen.decoded_token if chosen and chosen.decoded_token is not None
                    else self.tokenizer.decode([token_id]),
                    logprob=chosen.logprob if chosen else None,
                    top_logprobs=_top(entry, self.request.output.prompt_logprobs),
                )
            )
        text = output.prompt if output.prompt is not None else self.tokenizer.decode(ids)
        return PromptEvent(text=text, tokens=tuple(tokens))

    def _tokens(self, choice, metrics) -> list[TokenEvent]:
        ids = choice.token_ids
        if not ids:
            return []
        first = choice.index not in self.counts
        self.counts[choice.index] = self.counts.get(choice.index, 0) + len(ids)
        elapsed = time.monotonic() - self.started
        batch_size = self.batch_size()
        queue = _queue_wait(metrics) if first else None
        k = self.request.output.logprobs
        events = []
        last = len(ids) - 1
        finishing = choice.finish_reason is not None
        for i, token_id in enumerate(ids):
            entry = choice.logprobs[i] if choice.logprobs else None
            chosen = entry.get(token_id) if entry else None
            events.append(
                TokenEvent(
                    index=choice.index,
                    token_id=token_id,
                    # vLLM detokenizes per delta, not per token: the delta's text belongs to the
                    # token that completed it, the last one.
                    text=choice.text if i == last else "",
                    logprob=chosen.logprob if chosen else None,
                    top_logprobs=_top(entry, k),
                    special=token_id in self.special_ids,
                    token_text=chosen.decoded_token if chosen else None,
                    piece=self._piece(choice.index, token_id) if self.pieces is not None
                    else None,
                    last=finishing and i == last,
                    elapsed_s=elapsed,
                    batch_size=batch_size,
                    queue_s=queue if i == 0 else None,
                )
            )
        return events

    def _piece(self, index: int, token_id: int) -> str:
        """The text ``token_id`` adds after the tokens before it, decoded in a short window that
        starts in the prompt's tail (so tokenizers that drop a leading space on the first
        token still see context), as TGI's and vLLM's detokenizers do."""
        assert self.pieces is not None
        state = self.pieces.get(index)
        if state is None:
            tail = list(self.prompt_ids[-5:])
            state = self.pieces[index] = [tail, 0, len(tail)]
        ids, prefix, read = state
        ids.append(token_id)
        skip = self.request.output.skip_special_tokens
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=skip)
        after = self.tokenizer.decode(ids[prefix:], skip_special_tokens=skip)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            state[1], state[2] = read, len(ids)
            return after[len(before):]
        return ""

    def _final(self, index, finish_reason, stop_reason, metrics) -> FinalEvent:
        self.open.discard(index)
        return FinalEvent(
            index=index,
            finish_reason=_finish_reason(finish_reason, stop_reason,
                                         self.request.sampling.stop_token_ids),
            stop_reason=stop_reason,
            usage=Usage(prompt_tokens=len(self.prompt_ids),
                        completion_tokens=self.counts.get(index, 0)),
            timings=self._timings(metrics),
        )

    def _timings(self, metrics) -> Timings:
        if metrics is None or not getattr(metrics, "first_token_ts", 0):
            return Timings(ttft_s=time.monotonic() - self.started)
        return Timings(
            queue_s=_queue_wait(metrics),
            ttft_s=metrics.first_token_latency,
            decode_s=max(0.0, metrics.last_token_ts - metrics.first_token_ts),
        )


def _queue_wait(metrics) -> float:
    """Seconds from admission to first scheduling (0 when vLLM reported no stats)."""
    if metrics is None:
        return 0.0
    return max(0.0, metrics.scheduled_ts - metrics.queued_ts)


def _top(entry: dict[int, Any] | None, k: int | None) -> tuple[TopLogprob, ...]:
    if not entry or not k:
        return ()
    ranked = sorted(
        (lp.rank, token_id, lp) for token_id, lp in entry.items() if lp.rank is not None
    )
    return tuple(
        TopLogprob(token_id=token_id, text=lp.decoded_token or "", logprob=lp.logprob)
        for rank, token_id, lp in ranked
        if rank <= k
    )


def _finish_reason(reason: str, stop_reason: str | int | None,
                   requested_stop_ids: tuple[int, ...]) -> FinishReason:
    if reason == "stop":
        # vLLM adds the generation config's extra EOS ids (Llama 3's <|eot_id|>, ...) to the
        # stop token ids; stopping on one of those is an EOS, not a client's stop sequence.
        if stop_reason is None or (isinstance(stop_reason, int)
                                   and stop_reason not in requested_stop_ids):
            return "eos"
        return "stop_sequence"
    if reason in ("length", "abort", "error"):
        return reason  # type: ignore[return-value]
    return "error"
