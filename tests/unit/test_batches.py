"""The Batch API with the fake engine, through the openai SDK (docs/protocols/batches.md):
files, batches, results equal to interactive answers, bad lines per line, keys apart, a host
that restarts mid-batch running no line twice, cancellation."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from gateway.cluster.batches.build import batch_sender, store_for
from gateway.cluster.batches.service import BatchHost, LocalBatches
from gateway.cluster.ledger_actor import LocalLedger
from gateway.config import GatewayConfig
from gateway.ingress.asgi import create_app
from gateway.ingress.keys import ApiKey
from gateway.ingress.meter import BATCH_TIER, FLUSH_S
from gateway.ingress.registry import ModelRegistry
from tests.fake_engine import FakeEngine

KEYS = [ApiKey(key="alice-key", name="alice"), ApiKey(key="bob-key", name="bob"),
        ApiKey(key="narrow-key", name="narrow", models=["other-model"])]


class Gateway:
    """An app with the Batch API over a fake engine, its batch host in this process."""

    def __init__(self, root, engine=None, concurrency: int = 4, **config):
        self.engine = engine or FakeEngine()
        self.config = GatewayConfig(api_keys=KEYS, **config)
        self.registry = ModelRegistry({"fake-model": self.engine})
        self.ledger = LocalLedger()
        self.host = BatchHost(store_for(self.config, root),
                              batch_sender(self.registry, self.config, self.ledger),
                              concurrency)
        self.app = create_app(self.registry, self.config, ledger=self.ledger,
                              batches=LocalBatches(self.host))

    def sdk(self, key: str = "alice-key") -> openai.AsyncOpenAI:
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app),
                                 base_url="http://gw")
        return openai.AsyncOpenAI(base_url="http://gw/v1", api_key=key, max_retries=0,
                                  http_client=http)


def _line(custom_id: str, content: str, url: str = "/v1/chat/completions", **extra) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": "fake-model", "max_tokens": 5,
                     "messages": [{"role": "user", "content": content}], **extra}}


def _jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n"
                    for line in lines)


async def _finished(sdk: openai.AsyncOpenAI, batch_id: str, timeout_s: float = 20.0):
    async with asyncio.timeout(timeout_s):
        while True:
            batch = await sdk.batches.retrieve(batch_id)
            if batch.status in ("completed", "cancelled", "expired", "failed"):
                return batch
            await asyncio.sleep(0.02)


async def _results(sdk: openai.AsyncOpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    content = await sdk.files.content(file_id)
    return [json.loads(line) for line in content.text.splitlines()]


async def test_a_batch_answers_each_line_as_the_interactive_request_would(tmp_path):
    gw = Gateway(tmp_path)
    sdk = gw.sdk()
    lines = [_line(f"req-{i}", f"question {i}") for i in range(12)]
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(_jsonl(lines))
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h", metadata={"job": "nightly"})
    assert batch.status == "in_progress" and batch.request_counts.total == 12
    done = await _finished(sdk, batch.id)
    assert done.status == "completed" and done.error_file_id is None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 0)
    results = await _results(sdk, done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"req-{i}" for i in range(12))
    interactive = await sdk.chat.completions.create(**lines[3]["body"])
    [third] = [r for r in results if r["custom_id"] == "req-3"]
    body = third["response"]["body"]
    assert third["response"]["status_code"] == 200 and third["error"] is None
    assert body["choices"][0]["message"]["content"] == interactive.choices[0].message.content
    assert body["usage"]["completion_tokens"] == interactive.usage.completion_tokens
    # The lines ran at the batch tier, and count as alice's usage.
    priorities = [r.priority for r in gw.engine.requests]
    assert sum(p // 1000 == BATCH_TIER for p in priorities) == 12
    await asyncio.sleep(FLUSH_S * 2)
    usage = await gw.ledger.usage(None, "", "9999")
    assert sum(r.requests for r in usage if r.key == "alice") == 13
    listed = await sdk.batches.list()
    assert [b.id for b in listed.data] == [batch.id]
    assert (await sdk.files.retrieve(done.output_file_id)).purpose == "batch_output"


async def test_bad_lines_are_reported_each_in_the_error_file(tmp_path):
    gw = Gateway(tmp_path)
    sdk = gw.sdk()
    lines = [_line("ok-1", "hi"), b"{not json", {"custom_id": "no-body", "method": "POST",
                                                  "url": "/v1/chat/completions"},
             _line("wrong-url", "hi", url="/v1/completions"), _line("ok-1", "again"),
             _line("streamed", "hi", stream=True),
             _line("bad-params", "hi", temperature=-3), _line("ok-2", "bye")]
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    done = await _finished(sdk, batch.id)
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (8, 2, 6)
    errors = {e["error"]["line"] if e["error"] else e["custom_id"]: e
              for e in await _results(sdk, done.error_file_id)}
    assert set(errors) == {2, 3, 4, 5, 6, "bad-params"}
    assert "not valid JSON" in errors[2]["error"]["message"]
    assert errors[3]["custom_id"] == "no-body"
    assert "differs from the batch's endpoint" in errors[4]["error"]["message"]
    assert "not unique" in errors[5]["error"]["message"]
    assert "stream" in errors[6]["error"]["message"]
    rejected = errors["bad-params"]["response"]  # the engine's refusal, in OpenAI's shape
    assert rejected["status_code"] == 400 and "temperature" in rejected["body"]["error"]["message"]


async def test_files_and_batches_are_the_callers_own(tmp_path):
    gw = Gateway(tmp_path)
    alice, bob = gw.sdk("alice-key"), gw.sdk("bob-key")
    uploaded = await alice.files.create(file=("in.jsonl", _jsonl([_line("a", "hi")])),
                                        purpose="batch")
    batch = await alice.batches.create(input_file_id=uploaded.id,
                                       endpoint="/v1/chat/completions", completion_window="24h")
    for call in (bob.files.retrieve(uploaded.id), bob.files.content(uploaded.id),
                 bob.files.delete(uploaded.id), bob.batches.retrieve(batch.id),
                 bob.batches.cancel(batch.id),
                 bob.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                    completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            await call
    assert (await bob.files.list()).data == [] and (await bob.batches.list()).data == []
    await _finished(alice, batch.id)


async def test_refusals_are_openais_errors(tmp_path):
    gw = Gateway(tmp_path, batch_max_file_mib=1, batch_max_lines=3)
    sdk = gw.sdk()
    with pytest.raises(openai.APIStatusError) as large:
        await sdk.files.create(file=("big.jsonl", b"x" * (1024 * 1024 + 1)), purpose="batch")
    assert large.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="at most 3"):
        await sdk.files.create(file=("many.jsonl", _jsonl([_line(str(i), "hi") for i in range(4)])),
                               purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        await sdk.files.create(file=("in.jsonl", b"{}\n"), purpose="fine-tune")
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl([_line("a", "hi")])),
                                      purpose="batch")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings",
                                 completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        await sdk.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions",
                                 completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        await sdk.batches.retrieve("batch_nope")
    done = await _finished(sdk, (await sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h")).id)
    with pytest.raises(openai.ConflictError):
        await sdk.batches.cancel(done.id)


async def test_a_key_limited_to_other_models_gets_its_lines_refused(tmp_path):
    gw = Gateway(tmp_path)
    sdk = gw.sdk("narrow-key")
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl([_line("a", "hi")])),
                                      purpose="batch")
    done = await _finished(sdk, (await sdk.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions",
        completion_window="24h")).id)
    [error] = await _results(sdk, done.error_file_id)
    assert error["response"]["status_code"] == 404


async def test_a_restarted_host_runs_each_remaining_line_once(tmp_path):
    engine = FakeEngine(delay=0.01)
    first = Gateway(tmp_path, engine=engine, concurrency=2)
    sdk = first.sdk()
    lines = [_line(f"r{i}", f"q {i}") for i in range(20)]
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    while len(engine.requests) < 6:
        await asyncio.sleep(0.005)
    first.host._task.cancel()  # the host's process dies (lines in flight die with it)
    await asyncio.sleep(0.05)
    ran_before = {r.request_id for r in engine.requests}
    output = first.host.store.results_path(batch.id, "output")
    with output.open("ab") as out:  # a result line the crash cut short
        out.write(b'{"id": "batch_req_19_')
    second = Gateway(tmp_path, engine=engine, concurrency=2)  # same directory
    done = await _finished(second.sdk(), batch.id)
    assert done.status == "completed" and done.request_counts.completed == 20
    results = await _results(second.sdk(), done.output_file_id)
    assert sorted(r["custom_id"] for r in results) == sorted(f"r{i}" for i in range(20))
    # Each line ran once, but those in flight when the host died (at most its concurrency).
    assert len(engine.requests) - 20 <= 2 and len(ran_before) >= 6


async def test_a_cancelled_batch_ends_with_what_it_ran(tmp_path):
    gw = Gateway(tmp_path, engine=FakeEngine(delay=0.05), concurrency=1)
    sdk = gw.sdk()
    lines = [_line(f"r{i}", "q") for i in range(30)]
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    await asyncio.sleep(0.3)
    running = await sdk.batches.retrieve(batch.id)  # counts while it runs, not only at its end
    assert running.status == "in_progress" and 0 < running.request_counts.completed < 30
    cancelling = await sdk.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = await _finished(sdk, batch.id)
    assert done.status == "cancelled" and done.cancelled_at is not None
    assert 0 < done.request_counts.completed < 30
    assert len(await _results(sdk, done.output_file_id)) == done.request_counts.completed


async def test_without_a_batch_host_the_api_is_a_404_in_shape():
    app = create_app(ModelRegistry({"fake-model": FakeEngine()}), GatewayConfig())
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://gw") as http:
        r = await http.get("/v1/batches")
    assert r.status_code == 404 and "not enabled" in r.json()["error"]["message"]


async def test_a_batch_past_its_window_reports_the_lines_it_did_not_run(tmp_path):
    gw = Gateway(tmp_path, engine=FakeEngine(delay=0.02), concurrency=1)
    sdk = gw.sdk()
    lines = [_line(f"r{i}", "q") for i in range(10)]
    uploaded = await sdk.files.create(file=("in.jsonl", _jsonl(lines)), purpose="batch")
    batch = await sdk.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
    await asyncio.sleep(0.1)
    stored = gw.host.store.stored_batch(batch.id)
    stored.batch.expires_at = 0  # its window has passed
    gw.host.store.save(stored)
    done = await _finished(sdk, batch.id)
    assert done.status == "expired" and done.expired_at is not None
    counts = done.request_counts
    assert counts.completed + counts.failed == 10 and 0 < counts.failed < 10
    errors = await _results(sdk, done.error_file_id)
    assert len(errors) == counts.failed
    assert {e["error"]["code"] for e in errors} == {"batch_expired"}
