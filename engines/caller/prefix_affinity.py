"""Which replica of a model most likely holds a prompt's prefix in its KV cache, balanced against
load (docs/routing.md). No Ray in here: ``engines.caller.prefix_router`` runs this inside Serve's
request router, and the unit tests run it alone.

A prompt is read as text (``prompt_text``: a chat's roles and contents, a completion's text, a
token prompt's ids) and cut into blocks of ``BLOCK_CHARS`` characters; each block's key hashes it
together with every block before it (``prefix_blocks``), as vLLM hashes its KV blocks, so a key
names a whole prefix and two prompts share a key exactly where they share the text up to it. A
conversation's next turn resends its history, so its keys start with the keys of every earlier
turn; conversations that open with one long system prompt share that prompt's keys.

:class:`PrefixAffinity` remembers which replicas were sent which keys (the most recent few per
key, the last ``memory_blocks`` keys), learns what other routers sent from the replicas' own
records (``RecentPrompts``, published with Serve's routing stats), and picks for a new prompt
the replica holding its longest known prefix, unless that replica holds ``max_imbalance`` more
requests than the least-loaded one: then, or when no replica holds any of it, the least-loaded.
"""

from __future__ import annotations

import hashlib
import random
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

import msgspec

from contract import ChatPrompt, GenerateRequest, Prompt, TextPrompt

__all__ = ["BLOCK_CHARS", "MAX_BLOCKS", "Pick", "PrefixAffinity", "RecentPrompts",
           "chat_text", "prefix_blocks", "prompt_text", "request_keys"]

# 128 characters: about 32 tokens of English, two of vLLM's 16-token KV blocks. Smaller blocks
# tell prompts apart more finely but cost a hash each.
BLOCK_CHARS = 128
# Only a prompt's first 32K characters are keyed: enough to tell conversations apart, and it
# bounds the work a routing decision does (256 hashes) whatever the prompt's length.
MAX_BLOCKS = 256
# Replicas remembered per key, most recent first (a hot prefix is on several).
_HOLDERS = 4
_ROLE, _END = "\x1e", "\x1f"  # separators no text a client sends is likely to contain


def chat_text(messages: Iterable[tuple[str, str]]) -> str:
    """A chat as routing reads it: each message's role and text content, in order. Tool
    definitions and calls are left out: they change rarely within a conversation, and leaving
    them out keeps the text the same whether it is read from the internal prompt or from a
    request's raw JSON (``gateway.model_replica.router``)."""
    return "".join(f"{role}{_ROLE}{content}{_END}" for role, content in messages)


def prompt_text(prompt: Prompt) -> str:
    if isinstance(prompt, ChatPrompt):
        return chat_text((m.role, m.content) for m in prompt.messages)
    if isinstance(prompt, TextPrompt):
        return prompt.text
    ids = prompt.token_ids[:BLOCK_CHARS * MAX_BLOCKS // 2]  # every id takes two characters or more
    return "".join(f"{token}," for token in ids)


def prefix_blocks(text: str, adapter: str = "") -> tuple[int, ...]:
    """The keys of ``text``'s whole blocks (a partial last block has none): each a 64-bit hash
    of the text from its start to the block's end. With a LoRA ``adapter``, a first key for the
    adapter alone, and every block's key chained from it: an engine caches a prompt per adapter,
    and a replica that ran the adapter holds it loaded (docs/adapters.md)."""
    hasher = hashlib.blake2b(digest_size=8)
    end = min(len(text), BLOCK_CHARS * MAX_BLOCKS)
    keys = []
    if adapter:
        hasher.update(b"\0adapter\0" + adapter.encode("utf-8", "surrogatepass") + b"\0")
        keys.append(int.from_bytes(hasher.copy().digest(), "little"))
    for start in range(0, end - BLOCK_CHARS + 1, BLOCK_CHARS):
        hasher.update(text[start:start + BLOCK_CHARS].encode("utf-8", "surrogatepass"))
        keys.append(int.from_bytes(hasher.copy().digest(), "little"))
    return tuple(keys)


def request_keys(request: GenerateRequest) -> tuple[int, ...]:
    """A generation's prefix keys: its prompt's, under its LoRA adapter if it names one."""
    adapter = request.adapter.name if request.adapter is not None else ""
    return prefix_blocks(prompt_text(request.prompt), adapter)


class Pick(msgspec.Struct, frozen=True):
    """A routing decision: the replica, why (``prefix``: it holds ``matched`` of the prompt's
    ``blocks`` blocks; ``load``: the least loaded), for metrics and tests."""

    replica: str
    reason: Literal["prefix", "load"]
    matched: int
    blocks: int


class PrefixAffinity:
    """One router's memory of where prefixes went, and its choice of replica (module
    docstring). Replicas are named by Serve's full replica id strings."""

    def __init__(self, max_imbalance: int = 4, memory_blocks: int = 65536,
                 rng: random.Random | None = None):
        if max_imbalance < 0 or memory_blocks < 1:
            raise ValueError("max_imbalance must be >= 0 and memory_blocks >= 1")
        self.max_imbalance = max_imbalance
        self.memory_blocks = memory_blocks
        self._holders: OrderedDict[int, tuple[str, ...]] = OrderedDict()
        # What the replicas' own records say (RecentPrompts): key -> replicas.
        self._published: dict[int, tuple[str, ...]] = {}
        self._rng = rng or random.Random()

    def learn(self, published: Mapping[str, Iterable[int]]) -> None:
        """Replace what the replicas' records say (replica -> the keys it recorded)."""
        merged: dict[int, tuple[str, ...]] = {}
        for replica, keys in published.items():
            for key in keys:
                merged[key] = (*merged.get(key, ()), replica)
        self._published = merged

    def record(self, blocks: Sequence[int], replica: str) -> None:
        """``replica`` was sent a prompt with these keys."""
        for key in blocks:
            held = self._holders.pop(key, ())
            self._holders[key] = (replica, *(r for r in held if r != replica))[:_HOLDERS]
        while len(self._holders) > self.memory_blocks:
            self._holders.popitem(last=False)

    def holders(self, blocks: Sequence[int], alive: Mapping[str, object]) -> tuple[int, list[str]]:
        """The longest prefix of ``blocks`` some live replica holds (its length in blocks), and
        the live replicas holding it, the most recently sent first."""
        for depth in range(len(blocks), 0, -1):
            key = blocks[depth - 1]
            found = [r for r in (*self._holders.get(key, ()), *self._published.get(key, ()))
                     if r in alive]
            if found:
                return depth, list(dict.fromkeys(found))
        return 0, []

    def pick(self, blocks: Sequence[int], loads: Mapping[str, int]) -> Pick:
        """The replica for a prompt with keys ``blocks`` among ``loads`` (replica -> requests it
        holds now; every one can take another)."""
        if not loads:
            raise ValueError("no replica to pick from")
        least = min(loads.values())
        depth, holders = self.holders(blocks, loads)
        near = [r for r in holders if loads[r] - least <= self.max_imbalance]
        if near:  # the most recent holder among the least loaded of them
            best = min(loads[r] for r in near)
            return Pick(next(r for r in near if loads[r] == best), "prefix", depth, len(blocks))
        idle = sorted(r for r, load in loads.items() if load == least)
        return Pick(self._rng.choice(idle), "load", depth, len(blocks))


class RecentPrompts:
    """A replica's own record of the prompts it was sent: the last key of each of the last
    ``capacity`` (a conversation's next turn holds it among its own keys). Serve's routing
    stats carry it to every router of the model (``engines.caller.prefix_router``), so a router learns
    where other routers sent a conversation's earlier turns."""

    def __init__(self, capacity: int = 2048):
        self._keys: deque[int] = deque(maxlen=capacity)

    def note(self, request: GenerateRequest) -> None:
        """The last key of ``request``'s prompt, and the key of its LoRA adapter if it names
        one (other routers learn that this replica runs it)."""
        blocks = request_keys(request)
        if blocks:
            self._keys.append(blocks[-1])
        if request.adapter is not None and len(blocks) > 1:
            self._keys.append(blocks[0])

    def keys(self) -> list[int]:
        return list(dict.fromkeys(reversed(self._keys)))
