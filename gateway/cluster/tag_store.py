"""AICI's controller tags shared by all ingress replicas of one gateway application: a small
detached Ray actor per application (tags outlive a replica's restart, as AICI's runtime keeps
them on disk). ``protocols.aici.tags.TagStore`` is the interface; without Ray (unit tests, the
protocol alone) the protocol keeps its own in-process store."""

from __future__ import annotations

import asyncio

import ray

__all__ = ["SharedTagStore"]

NAMESPACE = "llm-gateway"


@ray.remote(num_cpus=0)
class _Tags:
    def __init__(self) -> None:
        self._tags: dict[str, dict] = {}

    def tags(self) -> dict[str, dict]:
        return dict(self._tags)

    def set(self, infos: list[dict]) -> None:
        for info in infos:  # re-set tags move to the end: the order of setting is kept
            self._tags.pop(info["tag"], None)
            self._tags[info["tag"]] = info


class SharedTagStore:
    def __init__(self, app_name: str) -> None:
        self._name = f"aici-tags-{app_name}"
        self._handle = None
        self._making = asyncio.Lock()

    async def _actor(self):
        # Made (or found) on first use: a gateway whose clients never tag runs no idle actor
        # process for it (each costs ~0.005 CPU-s/s, docs/results/benchmarks-2026-12-07.md). Ray
        # looks it up in the GCS synchronously: off the event loop. Restarted by Ray if its
        # process dies (tags set since are then lost; calls retry).
        async with self._making:
            if self._handle is None:
                self._handle = await asyncio.to_thread(
                    lambda: _Tags.options(name=self._name, namespace=NAMESPACE,
                                          lifetime="detached", get_if_exists=True,
                                          max_restarts=-1, max_task_retries=3).remote())
        return self._handle

    async def tags(self) -> dict[str, dict]:
        return await (await self._actor()).tags.remote()

    async def set(self, infos: list[dict]) -> None:
        await (await self._actor()).set.remote(infos)
