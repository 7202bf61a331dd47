"""The origin's sampler: one sequence's next token from LM-head logits, with vLLM's semantics.

Order (as vLLM v1): logit bias and ``min_tokens`` masking, repetition (prompt + output) then
frequency/presence (output) penalties, then temperature (0 → greedy), top-k, top-p, min-p and
typical-p, then a draw from a per-sequence generator (seeded when the request has a seed).
Reported logprobs are the model's raw distribution (vLLM's default ``raw_logprobs``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from contract import Sampling

__all__ = ["Sampler", "StepLogprobs"]

_GREEDY = 1e-5  # vLLM's threshold below which a temperature means greedy


@dataclass
class StepLogprobs:
    token_logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


class Sampler:
    """Per sequence: the request's knobs, the token counts penalties need, and the generator."""

    def __init__(self, sampling: Sampling, prompt_ids: list[int], eos_ids: frozenset[int],
                 vocab_size: int, seed_offset: int = 0):
        import torch

        self.s = sampling
        self.vocab_size = vocab_size
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # output tokens
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # prompt + output tokens
        if prompt_ids:
            self.seen[torch.tensor(prompt_ids)] = True
        self.generated = 0
        self.bias = None
        if sampling.logit_bias:  # one dense tensor, built in one call (LMQL sends ~vocab/2)
            self.bias = torch.zeros(vocab_size)
            self.bias[torch.tensor(list(sampling.logit_bias), dtype=torch.long)] = torch.tensor(
                list(sampling.logit_bias.values()), dtype=torch.float32)
        # Held back until min_tokens are out: EOS (unless ignored) and the stop token ids.
        blocked = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))
        self.blocked = torch.tensor(sorted(t for t in blocked if t < vocab_size), dtype=torch.long)
        seed = sampling.seed + seed_offset if sampling.seed is not None else random.getrandbits(63)
        self.generator = torch.Generator().manual_seed(seed)

    def sample(self, logits: Any, top_k_logprobs: int | None,
               mask: Any = None) -> tuple[int, StepLogprobs | None]:
        """The next token for ``logits`` (``[vocab]`` float32) and, when asked, its logprobs.
        ``mask``: a controller's additive row (0 / -inf), applied with the logit bias, as
        vLLM applies logits processors; the reported logprobs stay the model's."""
        import torch

        s = self.s
        logits = logits[: self.vocab_size]
        raw = logits
        x = logits.clone()
        if self.bias is not None:
            x += self.bias
        if mask is not None:
            x += mask[: self.vocab_size]
        if self.generated < s.min_tokens and len(self.blocked):
            x[self.blocked] = -float("inf")
        if s.repetition_penalty != 1.0:
            picked = x[self.seen]
            x[self.seen] = torch.where(picked > 0, picked / s.repetition_penalty,
                                       picked * s.repetition_penalty)
        if s.frequency_penalty or s.presence_penalty:
            x -= s.frequency_penalty * self.counts + s.presence_penalty * (self.counts > 0).float()
        if s.temperature < _GREEDY:
            token = int(torch.argmax(x))
        else:
            token = self._draw(x / s.temperature)
        self.generated += 1
        self.counts[token] += 1
        self.seen[token] = True
        if top_k_logprobs is None:
            return token, None
        logprobs = torch.log_softmax(raw, dim=-1)
        top: list[tuple[int, float]] = []
        if top_k_logprobs:
            values, ids = torch.topk(logprobs, top_k_logprobs)
            top = [(int(i), float(v)) for i, v in zip(ids, values, strict=True)]
        return token, StepLogprobs(float(logprobs[token]), top)

    def _draw(self, x) -> int:
        import torch

        s = self.s
        if s.top_k > 0 and s.top_k < x.numel():
            kth = torch.topk(x, s.top_k).values[-1]
            x = x.masked_fill(x < kth, -float("inf"))
        probs = torch.softmax(x, dim=-1)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = (torch.cumsum(sorted_p, 0) - sorted_p) >= s.top_p
            probs[order[drop]] = 0.0
        if s.min_p > 0.0:
            probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
        if s.typical_p < 1.0:
            probs = _typical(probs, s.typical_p)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


def _typical(probs, mass: float):
    """Typical sampling (Meister et al.): keep the tokens whose surprise is closest to the
    entropy, up to ``mass`` of probability."""
    import torch

    logp = torch.log(probs.clamp_min(1e-30))
    entropy = -(probs * logp).sum()
    order = torch.argsort((-logp - entropy).abs())
    cum = torch.cumsum(probs[order], 0)
    drop = (cum - probs[order]) >= mass
    out = probs.clone()
    out[order[drop]] = 0.0
    return out
