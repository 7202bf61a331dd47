"""The per-step controller hook inside vLLM: a logits processor that speaks the seed's main channel.

One class serves both of vLLM's logits-processor interfaces (``docs/protocols/aici.md``, "The vLLM hook"),
so whichever model runner vLLM picks loads it from the one name: the V1 runner's
(``vllm.v1.sample.logits_processor.LogitsProcessor``: ``__init__(config, device, pin)``,
``update_state`` with added / removed / moved rows and vLLM's live output lists; vLLM's x86 CPU
build runs this one) and Model Runner V2's (``vllm.v1.worker.gpu.sample.logits_processor``:
``__init__(config, req_states)``, ``add_request(slot, params)``, ``apply(logits, ctx)``; the
GPU default). Under MRV2 a row's new token is the one the step feeds (``ctx.input_ids``, at a
position past the prompt); a slot's previous request is reported freed when the slot is
reused (MRV2 has no removal callback; the frontend's ``advance`` takes a finished segment's
controller back anyway). Once per engine step, in ``apply()``, one round trip (the runtime's
``step``: the seed's two phases in one command, as AICI's ABI v2 merged them):

1. ``post_pre_process``: the tokens each controlled row gained since the last step
   (``post_ops``), rows new to the batch bound to their instantiated controller by ``req_id``
   (``pre_ops``), rows that left (``freed``);
2. ``mid_process`` for the rows that go on (``mid_ops``, less those step 1 ends), in batch
   order; their bias rows come back at offset 0 of the bias shm and are added to the logits;
3. a row whose controller stopped, failed, or asked for what vLLM cannot do in place
   (fast-forward, backtrack, fork, suspend) is *ended* this step: only its stop token may be
   sampled. The frontend then reads the controller's state from the runtime and resubmits
   ``prompt + kept tokens + forced tokens`` (prefix caching keeps that cheap) or finishes.

Requests opt in with ``SamplingParams.extra_args["aici"] = {"seq": <int>, "req_id": <str>}`` and
must make the tokenizer's EOS a stop token (``stop_token_ids``) with ``ignore_eos``: a sampled
EOS then ends the segment like a forced one, and the frontend decides, from the controller,
whether the request really ended (AICI ignores EOS unless the controller stops). The shm
prefix comes from the engine's ``additional_config["aici_prefix"]``; without it the hook is
inert and refuses controlled requests.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import msgspec
import numpy as np
import torch
from vllm import SamplingParams
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcessor as V2LogitsProcessor

from engines.controllers.api.masks import bits_to_bias
from engines.controllers.ipc.channels import MainClient, RuntimeReplyError
from engines.controllers.ipc.messages import MidOp, PostOp, PreOp, RowSpec, StepAnswer, Vocabulary, read
from engines.controllers.ipc.shm import BiasMatrix, ChannelError

__all__ = ["AICI_ARG", "ControllerLogitsProcessor", "parse_row_spec"]

logger = logging.getLogger(__name__)
AICI_ARG = "aici"
# A runtime that does not answer within this is gone (the per-controller bound is its own,
# far shorter): the rows it controlled end, and so does every later controlled row.
CHANNEL_TIMEOUT_S = 5.0
_LEFT_KEPT = 4096  # sequences that left the batch whose reported count is kept


def parse_row_spec(params: SamplingParams) -> RowSpec | None:
    """The request's controller binding, or None; ``ValueError`` when malformed."""
    spec = (params.extra_args or {}).get(AICI_ARG)
    if spec is None:
        return None
    try:
        spec = msgspec.convert(spec, RowSpec)  # strict: a binding is made by our frontend
    except msgspec.ValidationError:
        raise ValueError(f'extra_args["{AICI_ARG}"] is {{"seq": int, "req_id": str}}') from None
    if params.eos_token_id is not None and not params.ignore_eos:
        raise ValueError("a controlled request sets ignore_eos and lists EOS in stop_token_ids")
    return spec


@dataclass
class _Row:
    seq: int
    req_id: str
    output: list[int]  # vLLM's live list of this request's output ids
    stop_token: int | None  # the request's first stop_token_ids entry (its EOS)
    reported: int = 0
    bound: bool = False
    ending: bool = False


def _row_of(params: SamplingParams, output: list[int]) -> _Row | None:
    """A controlled request's row (its first stop token id is its EOS), or None."""
    spec = parse_row_spec(params)
    if spec is None:
        return None
    return _Row(spec.seq, spec.req_id, output, (params.stop_token_ids or [None])[0])


class ControllerLogitsProcessor(LogitsProcessor, V2LogitsProcessor):
    def __init__(self, vllm_config, *runner_args) -> None:
        # V1: (device, is_pin_memory); MRV2: (req_states,)
        self._req_states = runner_args[0] if len(runner_args) == 1 else None
        self._slots: dict[int, _Row] = {}  # MRV2: request slot → its row
        extra = getattr(vllm_config, "additional_config", None) or {}
        prefix = extra.get("aici_prefix") if isinstance(extra, dict) else None
        self._rows: dict[int, _Row] = {}
        self._freed: list[int] = []
        # Tokens reported per sequence that left the batch: vLLM re-adds a preempted request
        # later with the same output list, and its controller must not hear them twice.
        self._left: OrderedDict[int, int] = OrderedDict()
        self._dead = ""
        self._main: MainClient | None = None
        self._bias: BiasMatrix | None = None
        self._buffer = np.empty((0, 0, 8), np.float32)  # a step's masks as 0 / -inf rows
        if prefix:
            # The replica created the objects before starting vLLM; this end opens them.
            self._main = MainClient(prefix, create=False)
            self._bias = BiasMatrix(prefix, create=False)
            answer = self._main.call("tokens", timeout=CHANNEL_TIMEOUT_S)
            self._vocab = read(answer, Vocabulary).vocab_size

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        parse_row_spec(sampling_params)

    def is_argmax_invariant(self) -> bool:
        return False  # masks change the greedy choice

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is not None:
            self._update(batch_update)
        # The V1 runner calls this every step before the forward pass, each row's output
        # already holding the last step's token: the step's command goes out now and the
        # runtime works beside the forward pass (as AICI runs mid_process); apply() takes the
        # answer. Nothing may raise here (it would take the engine down).
        if self._main is None or self._dead or not (self._rows or self._freed):
            return
        try:
            if self._main.waiting:  # sent last step, no apply since (a step sampled nothing)
                self._fold(self._main.receive(CHANNEL_TIMEOUT_S))
            if any(row.output and row.output[-1] < 0 for row in self._rows.values()):
                return  # async scheduling: a token is known only in apply(), which sends
            self._main.send("step", timeout=CHANNEL_TIMEOUT_S, **self._command())
        except ChannelError as exc:
            self._lost(exc)
        except Exception as exc:  # a refused step, an oversize command: these rows end
            logger.error("controller step failed (%s); ending its rows", exc)
            for row in self._rows.values():
                row.ending = True

    def _update(self, batch_update: BatchUpdate) -> None:
        for index in batch_update.removed:
            self._free(index)
        for index, params, _prompt, output in batch_update.added:
            self._free(index)  # an added request may replace one at the same index
            row = _row_of(params, output) if params is not None else None
            if row is not None:
                row.reported = self._left.pop(row.seq, 0)  # resumed after a preemption
                self._rows[index] = row
        for a, b, direction in batch_update.moved:
            row_a = self._rows.pop(a, None)
            row_b = self._rows.pop(b, None)
            if direction == MoveDirectionality.SWAP:
                if row_b is not None:
                    self._rows[a] = row_b
            elif row_b is not None:  # moved onto: the old occupant left the batch
                self._leave(row_b)
            if row_a is not None:
                self._rows[b] = row_a

    def _free(self, index: int) -> None:
        row = self._rows.pop(index, None)
        if row is not None:
            self._leave(row)

    def _leave(self, row: _Row) -> None:
        if row.bound:
            self._freed.append(row.seq)
        self._left[row.seq] = row.reported
        while len(self._left) > _LEFT_KEPT:  # finished ones are never re-added
            self._left.popitem(last=False)

    # --- Model Runner V2 ----------------------------------------------------------------------

    def add_request(self, req_idx: int, sampling_params: SamplingParams) -> bool:
        old = self._slots.pop(req_idx, None)
        if old is not None and old.bound:  # the slot's previous request is gone
            self._freed.append(old.seq)
        row = _row_of(sampling_params, [])
        if row is None:
            return False
        self._slots[req_idx] = row
        return True

    def _v2_rows(self, logits: torch.Tensor, ctx) -> None:
        """This step's batch rows of controlled slots, each given the token the step feeds
        when it is an output token (sampled last step)."""
        slots = [int(s) for s in ctx.idx_mapping_np]
        self._rows = {}
        if not self._slots:
            return
        if logits.shape[0] != len(slots):  # a row per draft token: speculative decoding
            raise RuntimeError("controllers do not run with speculative decoding")
        feeds = [(i, slot) for i, slot in enumerate(slots) if slot in self._slots]
        if not feeds:
            return
        rows = torch.tensor([i for i, _ in feeds], dtype=torch.long, device=ctx.input_ids.device)
        tokens = ctx.input_ids[rows].tolist()
        positions = ctx.pos[rows].tolist()
        prompt_len = self._req_states.prompt_len.np
        for (i, slot), token, pos in zip(feeds, tokens, positions, strict=True):
            row = self._slots[slot]
            if pos >= int(prompt_len[slot]) and pos - int(prompt_len[slot]) == len(row.output):
                row.output.append(int(token))
            self._rows[i] = row

    def apply(self, logits: torch.Tensor, ctx=None) -> torch.Tensor:
        if ctx is not None:  # MRV2
            try:
                self._v2_rows(logits, ctx)
            except RuntimeError as exc:  # every row of a controlled request ends
                mapping = [int(s) for s in ctx.expanded_idx_mapping.tolist()]
                self._rows = {i: self._slots[s] for i, s in enumerate(mapping)
                              if s in self._slots}
                return self._end(logits, list(self._rows), str(exc))
        sent = self._main is not None and self._main.waiting  # by update_state (V1)
        if not self._rows and not self._freed and not sent:
            return logits
        if self._main is None or self._dead:
            return self._end(logits, list(self._rows), self._dead or
                             "controllers are not enabled on this engine")
        try:
            if not sent:  # MRV2 (no update_state), or rows that update_state did not see
                self._main.send("step", timeout=CHANNEL_TIMEOUT_S, **self._command())
            ending = self._answer(logits, self._main.receive(CHANNEL_TIMEOUT_S))
        except ChannelError as exc:
            self._lost(exc)
            ending = set(self._rows)
        except RuntimeReplyError as exc:  # this step failed; the runtime is still there
            logger.error("controller runtime refused a step (%s); ending its rows", exc)
            ending = set(self._rows)
        return self._end(logits, sorted(ending), "")

    def _lost(self, exc: ChannelError) -> None:
        self._dead = f"controller runtime unreachable: {exc}"
        logger.error("%s; ending every controlled row", self._dead)

    def _command(self) -> dict:
        """The runtime's ``step`` (post_pre_process, then mid_process for the rows that go
        on) for the rows as they stand: tokens each gained since it was last reported, rows
        new to the batch, rows that left."""
        post_ops, pre_ops = [], []
        for row in self._rows.values():
            if not row.bound:
                pre_ops.append(PreOp(id=row.seq, req_id=row.req_id))
                row.bound = True
            new = []
            for token in row.output[row.reported:]:
                if token < 0:  # async scheduling's placeholder: known next step
                    break
                new.append(token)
            if new:
                post_ops.append(PostOp(id=row.seq, tokens=new, backtrack=0))
                row.reported += len(new)
        freed, self._freed = self._freed, []
        return {"post_ops": post_ops, "pre_ops": pre_ops, "freed": freed, "mask_format": "bits",
                "mid_ops": [MidOp(id=self._rows[i].seq)
                            for i in sorted(self._rows) if not self._rows[i].ending]}

    def _fold(self, data: dict) -> None:
        """An answer no apply() used: its masks are stale (the next step asks again), but the
        rows it ends still end."""
        ends = read(data, StepAnswer).ends()
        for row in self._rows.values():
            row.ending = row.ending or row.seq in ends

    def _answer(self, logits: torch.Tensor, data: dict) -> set[int]:
        """Apply a step's answer to this step's logits. Returns the rows to end this step."""
        answer = read(data, StepAnswer)
        ends = answer.ends()
        index_of = {row.seq: i for i, row in self._rows.items()}
        rows = [index_of.get(seq, -1) for seq in answer.mid.ids]
        if rows:  # a bias row of a sequence no longer in the batch (none should be) is skipped
            self._mask(logits, rows, {*answer.mid.unmasked,
                                      *(k for k, i in enumerate(rows) if i < 0)})
        return {i for i, row in self._rows.items() if row.ending or row.seq in ends}

    def _mask(self, logits: torch.Tensor, rows: list[int], skip: set[int]) -> None:
        """Bitmask ``k`` of the shm (``uint32`` words, bit ``t % 32`` of word ``t // 32``)
        belongs to batch row ``rows[k]``; banned ids become ``-inf``. ``skip``: rows left
        unconstrained (our runtime says which)."""
        width = min(self._vocab, logits.shape[1])
        masked = [k for k in range(len(rows)) if k not in skip]
        if not masked:
            return
        words = self._bias.words(len(rows), self._vocab)
        if len(masked) < len(rows):
            words = words[masked]
        # Into a buffer kept across steps, which also copies: no view of the shm outlives the
        # step. Little-endian words, so byte k of word j holds tokens 32j + 8k .. 32j + 8k + 7.
        # At batch 16 this and the index_add_ take 0.9 ms where a fresh lookup array and an
        # indexed += took 1.8 ms (one torch thread).
        n, width_bytes = words.shape[0], words.shape[1] * 4
        if self._buffer.shape[0] < n or self._buffer.shape[1] != width_bytes:
            self._buffer = np.empty((n, width_bytes, 8), np.float32)
        bias = bits_to_bias(words, self._buffer[:n])
        index = torch.tensor([rows[k] for k in masked], dtype=torch.long, device=logits.device)
        source = torch.from_numpy(bias[:, :width])
        logits[:, :width].index_add_(0, index, source.to(logits.device, logits.dtype))
        if logits.shape[1] > width:  # ids past the controllers' vocabulary: never allowed
            logits[index, width:] = float("-inf")

    def _end(self, logits: torch.Tensor, rows: list[int], why: str) -> torch.Tensor:
        """Only the stop token may be sampled on these rows: vLLM finishes them this step."""
        if why and rows:
            logger.warning("ending %d controlled rows: %s", len(rows), why)
        for index in rows:
            row = self._rows[index]
            row.ending = True
            logits[index] = float("-inf")
            if row.stop_token is not None and row.stop_token < logits.shape[1]:
                logits[index, row.stop_token] = 0.0
        return logits
