"""files.list and files.delete of the Batch API, with the real openai SDK against a real
gateway (a thread) on a real Valkey: OpenAI's shapes and pagination, one tenant never
sees or deletes another's files, and a file that a batch which has not finished reads is
not deleted. No replica: the batches here are created in the store (as `conveyor batch`
or another gateway would) and held under another runner's lease, so none runs."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import redis.asyncio as aioredis
from gateway_harness import GatewayThread, openai_client
from scratch import scratch_namespace

from conveyor.apps.openai_api.batch_store import BatchStore
from conveyor.gateway import batch_routes

LINE = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}}


@pytest.fixture(scope="module")
def tenants(redis_url):
    with scratch_namespace(redis_url, "files-a") as ns_a, scratch_namespace(redis_url, "files-b") as ns_b:
        yield {"key-a": ns_a, "key-b": ns_b}


@pytest.fixture(scope="module")
def gateway(redis_url, tenants):
    with GatewayThread(redis_url, keys=tenants, extra_routers=(batch_routes.router,)) as running:
        yield running


def upload(client: openai.OpenAI, name: str):
    return client.files.create(file=(name, json.dumps(LINE).encode() + b"\n"), purpose="batch")


def in_store(redis_url: str, ns: str, work):
    """Run `work(store)` on a BatchStore of `ns` (what another runner or `conveyor batch` writes)."""

    async def run():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await work(BatchStore(client, ns))
        finally:
            await client.aclose()

    return asyncio.run(run())


def test_files_list_pages_newest_first_and_filters_by_purpose(gateway):
    client = openai_client(gateway, api_key="key-a")
    made = [upload(client, f"f{i}.jsonl").id for i in range(3)]
    page = client.files.list(limit=2)
    assert [f.id for f in page.data] == made[::-1][:2] and page.has_more
    assert [f.id for f in client.files.list(limit=2)] == made[::-1]  # the SDK pages on with `after`
    assert [f.id for f in client.files.list(order="asc")] == made
    assert all(f.purpose == "batch" and f.object == "file" for f in client.files.list(purpose="batch"))
    assert list(client.files.list(purpose="batch_output")) == []
    for bad, param in (({"limit": 0}, "limit"), ({"limit": 10_001}, "limit"), ({"order": "sideways"}, "order")):
        with pytest.raises(openai.BadRequestError, match=param):
            client.files.list(**bad)


def test_files_delete_and_tenants_see_only_their_own(gateway):
    a, b = openai_client(gateway, api_key="key-a"), openai_client(gateway, api_key="key-b")
    mine = upload(a, "mine.jsonl")
    assert mine.id not in [f.id for f in b.files.list()]
    with pytest.raises(openai.NotFoundError):
        b.files.delete(mine.id)
    deleted = a.files.delete(mine.id)
    assert deleted.id == mine.id and deleted.deleted and deleted.object == "file"
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.files.content(mine.id)
    assert mine.id not in [f.id for f in a.files.list()]
    with pytest.raises(openai.NotFoundError):
        a.files.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        a.files.delete("file-no:such")  # ids never reach a key name unchecked


def test_a_file_that_an_unfinished_batch_reads_is_not_deleted(gateway, redis_url, tenants):
    client = openai_client(gateway, api_key="key-a")
    used = upload(client, "used.jsonl")
    batch_id = "batch_held_by_another_runner"

    async def create_held(store: BatchStore):
        await store.claim(batch_id, "another-runner", 120_000)  # no runner of this gateway may run it
        await store.create_batch(
            input_file_id=used.id, endpoint="/v1/completions", completion_window="24h", metadata={}, batch_id=batch_id
        )

    in_store(redis_url, tenants["key-a"], create_held)
    with pytest.raises(openai.ConflictError, match=batch_id) as refused:
        client.files.delete(used.id)
    assert refused.value.code == "file_in_use"
    assert client.files.retrieve(used.id).id == used.id

    async def finish(store: BatchStore):
        return await store.transition(batch_id, ("validating",), "cancelled")

    assert in_store(redis_url, tenants["key-a"], finish) == (True, "cancelled")
    assert client.files.delete(used.id).deleted
