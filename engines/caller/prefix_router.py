"""Prefix-aware routing as Ray Serve's own request router (``RequestRouter``): every handle to
a model's engine deployment picks a replica with it, in the gateway's ingress replicas (requests
that take the engine channel) and in the model's ingress request router (requests HAProxy sends
to the model's own application, ``gateway.model_replica.router``). The policy is
``engines.caller.prefix_affinity``, the options and the request's prompt ``engines.caller.routing``;
docs/routing.md.

This module holds the router class alone: Serve pickles it by value into each routing process,
so what it defines is copied there (``engines.caller.routing`` says why that matters).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any

from ray.serve._private.request_router.common import PendingRequest
from ray.serve._private.request_router.replica_wrapper import RunningReplica
from ray.serve._private.request_router.request_router import RequestRouter

from engines.caller.prefix_affinity import Pick, PrefixAffinity
from engines.caller.routing import ROUTING_STATS_KEY, request_blocks
from engines.kit.telemetry import engine_metrics

__all__ = ["PrefixAwareRouter"]

log = logging.getLogger("ray.serve")
# A replica HAProxy was just told to use counts one more request for this long: the request is
# on its way (HAProxy forwards it after the answer), and until it arrives the replica's own
# count misses it, so a burst would all be sent to the same idle replica.
_IN_TRANSIT_S = 0.5


class PrefixAwareRouter(RequestRouter):
    """Serve's request router for a model's engine replicas (module docstring)."""

    def initialize_state(self, model: str = "", max_imbalance: int = 4,
                         memory_blocks: int = 65536, **_: Any):
        self.affinity = PrefixAffinity(max_imbalance, memory_blocks)
        self.model = model
        self.picks: dict[str, int] = {"prefix": 0, "load": 0}
        self._last_loads: dict[str, int] = {}
        self._sent: deque[tuple[float, str]] = deque()  # this router's recent answers
        self._probing: asyncio.Future | None = None
        self._measured_at = 0.0  # when the last probe round that came back began

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.affinity.learn({r.replica_id.to_full_id_str(): r.routing_stats.get(ROUTING_STATS_KEY, ())
                             for r in replicas})

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None,
                              ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        blocks, question = request_blocks(pending_request.args if pending_request else ())
        loads = self._loads(candidate_replicas, question)
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        open_loads = {rid: load for rid, load in loads.items()
                      if load < by_id[rid].max_ongoing_requests}
        if not open_loads:  # every replica full: Serve backs off and asks again
            return [candidate_replicas]
        pick = self.affinity.pick(blocks, open_loads)
        log.debug("routing %s: %s, loads %s", self._deployment_id, pick, open_loads)
        self.affinity.record(blocks, pick.replica)
        if question:
            self._sent.append((time.monotonic(), pick.replica))
        self._count(pick)
        return [[by_id[pick.replica]]]

    def _loads(self, replicas: list[RunningReplica], question: bool) -> dict[str, int]:
        """Requests each replica holds, without waiting for anything: Serve's queue-length
        cache, which the requests this router sends keep current, and which a probe of every
        replica refreshes in the background (one round at a time; a decision that waited for
        its probes took up to Serve's 0.1 s deadline when the replicas' event loops were busy
        streaming, measured on TTFT). A replica the cache knows nothing of keeps its last known
        load; one a probe found dead is left out. On a question (no request follows through
        this router), each request it pointed at a replica since the last probe round began
        (within ``_IN_TRANSIT_S``) counts once more: HAProxy forwards it after the answer, and
        the replica's count may miss it."""
        self._probe_in_background(replicas)
        cache = self.replica_queue_len_cache
        loads: dict[str, int] = {}
        for r in replicas:
            if r.replica_id not in self.curr_replicas:  # a probe found it dead: Serve dropped it
                continue
            rid = r.replica_id.to_full_id_str()
            known = cache.get(r.replica_id)
            loads[rid] = self._last_loads.get(rid, 0) if known is None else known
        self._last_loads = dict(loads)
        if question:
            since = max(self._measured_at, time.monotonic() - _IN_TRANSIT_S)
            while self._sent and self._sent[0][0] <= since:
                self._sent.popleft()
            for _, rid in self._sent:
                if rid in loads:
                    loads[rid] += 1
        return loads

    def _probe_in_background(self, replicas: list[RunningReplica]) -> None:
        """One round of probes at a time; once it is in, the requests sent before it began are
        in the replicas' counts, and no longer counted as in transit (counted twice, a busy
        replica's load was inflated and its conversations sent elsewhere: fewer cache hits)."""
        if self._probing is None or self._probing.done():
            began = time.monotonic()
            self._probing = asyncio.ensure_future(self._probe_queue_lens(replicas, 0))
            self._probing.add_done_callback(lambda _: self._measured(began))

    def _measured(self, began: float) -> None:
        self._measured_at = max(self._measured_at, began)

    def _count(self, pick: Pick) -> None:
        self.picks[pick.reason] += 1
        engine_metrics().routing_picks.inc(tags={"model": self.model, "reason": pick.reason})
        if sum(self.picks.values()) % 100 == 1:
            log.info("prefix routing for %s: %s", self._deployment_id, self.picks)
