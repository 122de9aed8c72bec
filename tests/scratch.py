"""A throwaway key namespace on the test server, deleted afterwards."""

import uuid
from contextlib import contextmanager

import redis


@contextmanager
def scratch_namespace(redis_url: str, prefix: str = "test"):
    ns = f"{prefix}-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{ns}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
