"""``conveyor demo``: one replica in this process, a handful of plain and chat prompts
submitted through the async client, answers streamed to the terminal, clean shutdown."""

import asyncio
import sys

from conveyor.actors.config import ReplicaConfig
from conveyor.actors.replica import Replica
from conveyor.clients import AsyncClient

PROMPTS = [
    {"prompt": "The three primary colors are", "max_tokens": 32},
    {"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 48},
    {"messages": [{"role": "user", "content": "Write a haiku about message queues."}], "max_tokens": 48},
    {
        "messages": [{"role": "user", "content": "Give me one tip for writing clear code."}],
        "max_tokens": 64,
        "priority_class": "batch",
    },
    {"prompt": "def fibonacci(n):", "max_tokens": 48, "stop": ["\n\n"]},
]


async def run(engine, config: ReplicaConfig) -> int:
    replica = Replica(engine, config)
    serving = asyncio.create_task(replica.run())
    client = AsyncClient(namespace=config.namespace, connection=config.redis)
    try:
        jobs = [await client.submit(temperature=0, **job) for job in PROMPTS]
        for job, spec in zip(jobs, PROMPTS):
            await _show(job, spec)
    finally:
        await client.close()
        replica.request_stop()
    try:
        return await serving
    finally:
        await engine.aclose()


async def _show(job, spec) -> None:
    question = spec.get("prompt") or spec["messages"][-1]["content"]
    print(f"\n\033[1m> {question}\033[0m")
    async for event in job.stream(timeout=300):
        sys.stdout.write(event.text)
        sys.stdout.flush()
    result = await job.result(timeout=60)
    timings = result.timings
    print(
        f"\n\033[2m[{result.finish_reason}, {result.usage.completion_tokens} tokens, "
        f"TTFT {timings.ttft:.2f}s, e2e {timings.e2e:.2f}s]\033[0m"
    )
