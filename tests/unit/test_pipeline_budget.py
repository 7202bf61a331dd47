"""The pipeline's KV-cache budget (docs/protocols/pipeline.md, "Batching", bounds): requests
reserve their longest length, wait in order, are refused when too many wait or when one alone
could never fit; under load no stage holds more than the budget."""

from __future__ import annotations

import asyncio

import pytest

from contract import ErrorEvent, FinalEvent, GenerateRequest, Sampling, TextPrompt
from engines.kit.config import ModelConfig
from engines.pipeline.budget import BudgetFull, KVBudget, NeverFits, tokens_for
from engines.pipeline.engine import PipelineEngine
from engines.pipeline.loading import load_layers
from engines.pipeline.stage import StageCore
from engines.pipeline.stages import LocalStages
from engines.replica.host import EngineHost


async def test_reservations_wait_in_order_and_give_back():
    budget = KVBudget(10, max_waiting=2)
    order: list[str] = []
    first = budget.reserve(6)
    await first.__aenter__()

    async def take(name: str, need: int) -> None:
        async with budget.reserve(need):
            order.append(name)
            await asyncio.sleep(0.01)

    big = asyncio.create_task(take("big", 8))  # waits for the first to end
    await asyncio.sleep(0)
    small = asyncio.create_task(take("small", 2))  # fits now, but waits behind the big one
    await asyncio.sleep(0.01)
    assert order == [] and budget.free == 4
    with pytest.raises(BudgetFull):
        async with budget.reserve(1):
            pass
    await first.__aexit__(None, None, None)
    await asyncio.gather(big, small)
    assert order == ["big", "small"] and budget.free == 10
    with pytest.raises(NeverFits, match="needs 11 tokens"):
        async with budget.reserve(11):
            pass


async def test_a_waiter_that_leaves_takes_nothing_with_it():
    budget = KVBudget(10, max_waiting=4)
    async with budget.reserve(10):
        waiter = asyncio.create_task(budget.reserve(5).__aenter__())
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
    assert budget.free == 10 and not budget._waiting


def test_tokens_for_counts_keys_and_values_of_every_layer():
    class Config:
        num_attention_heads, num_key_value_heads, head_dim, hidden_size = 9, 3, 64, 576

    # 2 (keys, values) x 3 heads x 64 x 4 bytes x 10 layers = 15360 bytes a token
    assert tokens_for(1.0, Config, 10, 4) == (1 << 30) // 15360



class Watched(LocalStages):
    """Records the most tokens any stage held at once."""

    most = 0

    def submit(self, hop, check):
        result = super().submit(hop, check)
        Watched.most = max(Watched.most, *(sum(c.cached().values()) for c in self.cores))
        return result


def _engine(tiny_dir, budget_tokens: int, max_waiting: int) -> PipelineEngine:
    config = ModelConfig(name="tiny", engine="pipeline", source=str(tiny_dir),
                         engine_args={"stages": [[1, 3], [3, 6]], "prefill_chunk": 4})
    cores = [StageCore(load_layers(tiny_dir, a, b), a, b) for a, b in [(1, 3), (3, 6)]]
    engine = PipelineEngine(config, stages=Watched(cores))
    engine.kv_budget = KVBudget(budget_tokens, max_waiting)
    return engine


def _req(rid: str, max_tokens: int, n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=rid, model="tiny",
                           prompt=TextPrompt(text="The capital of France is"),
                           sampling=Sampling(temperature=0, max_tokens=max_tokens, n=n,
                                             ignore_eos=True))


async def _collect(host: EngineHost, request: GenerateRequest) -> list:
    return [e async for e in host.generate(request)]


async def test_under_load_no_stage_holds_more_than_the_budget(tiny_dir):
    engine = _engine(tiny_dir, budget_tokens=60, max_waiting=16)  # two requests of 30 at once
    host = EngineHost(engine)
    Watched.most = 0
    runs = await asyncio.gather(*(_collect(host, _req(f"r{i}", 24)) for i in range(8)))
    assert all(isinstance(events[-1], FinalEvent) for events in runs)
    assert 30 < Watched.most <= 60  # two ran together, never three
    assert engine.kv_budget.free == 60


async def test_too_many_waiting_is_overloaded_and_one_too_large_is_a_validation_error(tiny_dir):
    engine = _engine(tiny_dir, budget_tokens=60, max_waiting=1)
    host = EngineHost(engine)
    # One runs, one waits, one is refused.
    runs = await asyncio.gather(*(_collect(host, _req(f"o{i}", 40)) for i in range(3)))
    refused = [events[0] for events in runs if isinstance(events[0], ErrorEvent)]
    assert len(refused) == 1 and refused[0].kind == "overloaded"
    assert "retry later" in refused[0].message
    too_large = [e async for e in host.generate(_req("big", 30, n=2))]  # 2 x (5 + 30) > 60
    assert isinstance(too_large[0], ErrorEvent) and too_large[0].kind == "validation"
    assert too_large[0].param == "max_tokens" and "needs 70 tokens" in too_large[0].message


def test_the_kind_table_knows_the_pipelines_default_concurrency():
    from engines.kit.kinds import ENGINE_KINDS
    from engines.pipeline.config import PipelineArgs

    assert ENGINE_KINDS["pipeline"].default_concurrency == PipelineArgs().max_sequences
