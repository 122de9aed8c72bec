"""docs/dashboard.png: the operator's dashboard under load, as an operator sees it.

A real deployment on this machine: an embedded Valkey, `conveyor serve --model smollm2`
(the bundled SmolLM2), `conveyor gateway`, a few hundred interactive and batch-class jobs,
a Batch API batch, and two junk entries that end as dead letters. Debian's chromium
(through playwright) opens /dashboard once the charts have a minute of samples.

    .venv/bin/python benchmarks/dashboard_screenshot.py [--out docs/dashboard.png] [--wait-s 60]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from conveyor.actors.embedded_valkey import EmbeddedValkey
from conveyor.clients import Client
from conveyor.clients.keys import Keys

REPO = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
NAMESPACE = "conveyor"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def conveyor(*args: str, log: Path) -> subprocess.Popen:
    env = {**os.environ, "CONVEYOR_NAMESPACE": NAMESPACE}
    return subprocess.Popen(
        [sys.executable, "-m", "conveyor", *args],
        cwd=REPO,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
    )


def wait_for(url: str, timeout_s: float) -> None:
    ends = time.monotonic() + timeout_s
    while time.monotonic() < ends:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} did not answer within {timeout_s:.0f} s")


def load(redis_url: str, gateway_url: str) -> None:
    """Interactive and batch-class jobs, a Batch API batch, and two entries that dead-letter."""
    client = Client(redis_url, namespace=NAMESPACE)
    topics = ("a queue", "paged attention", "a lighthouse", "Redis streams", "the sea", "a compiler")
    items = [
        {"prompt": f"Write a short paragraph about {topics[i % len(topics)]}.", "max_tokens": 96, "model": "smollm2"}
        for i in range(160)
    ]
    items += [{**item, "priority_class": "batch"} for item in items[:80]]
    client.submit_many(items, progress=False)
    lines = [
        {
            "custom_id": f"doc-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "smollm2",
                "max_tokens": 48,
                "messages": [{"role": "user", "content": f"Summarize item {i}."}],
            },
        }
        for i in range(24)
    ]
    upload = httpx.post(
        f"{gateway_url}/v1/files",
        files={"file": ("batch.jsonl", io.BytesIO("\n".join(map(json.dumps, lines)).encode()))},
        data={"purpose": "batch"},
    ).json()
    httpx.post(
        f"{gateway_url}/v1/batches",
        json={"input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    ).raise_for_status()
    raw = client.redis
    raw.xadd(Keys(NAMESPACE).requests("interactive"), {"json": b"{not json"})
    raw.xadd(Keys(NAMESPACE).requests("interactive"), {"json": json.dumps({"job_id": "x", "max_tokens": -5})})
    client.close()


def watch_then_screenshot(url: str, out: Path, load_s: float, start_load) -> None:
    """Open the page first, as an operator watching the load would (the gateway samples the
    throughput chart while someone reads it), then take the picture after `load_s`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, args=["--headless", "--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1440, "height": 1000}, device_scale_factor=1)
        page.goto(url)
        start_load()
        for waited in range(0, int(load_s), 10):
            print(f"[screenshot] under load: {waited} s of {load_s:.0f}", flush=True)
            page.wait_for_timeout(10_000)
        page.screenshot(path=str(out), full_page=True)
        browser.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "dashboard.png")
    parser.add_argument("--wait-s", type=float, default=60.0, help="load time before the screenshot (chart history)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder, EmbeddedValkey(Path(folder) / "valkey", password=None) as valkey:
        port, logs = free_port(), Path(folder)
        serve = conveyor("serve", "--model", "smollm2", "--redis-url", valkey.url, log=logs / "serve.log")
        gateway = conveyor("gateway", "--redis-url", valkey.url, "--port", str(port), log=logs / "conveyor.gateway.log")
        try:
            gateway_url = f"http://127.0.0.1:{port}"
            wait_for(f"{gateway_url}/health", 120)
            print(f"[screenshot] gateway {gateway_url}; queueing jobs", flush=True)
            start_load = lambda: load(valkey.url, gateway_url)  # noqa: E731
            watch_then_screenshot(f"{gateway_url}/dashboard", args.out, args.wait_s, start_load)
            print(f"[screenshot] wrote {args.out}")
        finally:
            for process in (gateway, serve):
                process.terminate()
            for process in (gateway, serve):
                process.wait(timeout=90)


if __name__ == "__main__":
    main()
