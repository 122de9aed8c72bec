"""The compose deployment, checked without a Docker engine: parse the files and run the
engine service's own command locally against a local server."""
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clients import Client

COMPOSE = Path(__file__).resolve().parents[1] / "compose"


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def test_redis_service_persists_and_reports_health(compose):
    redis_service = compose["services"]["redis"]
    assert "--appendonly" in redis_service["command"] and "yes" in redis_service["command"]
    assert redis_service["healthcheck"]["test"][-1] == "ping"


def test_engine_waits_for_healthy_redis_and_drains_on_sigterm(compose):
    engine = compose["services"]["engine"]
    assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    grace = float(engine["environment"]["CONVEYOR_GRACE_S"])
    assert float(engine["stop_grace_period"].rstrip("s")) > grace
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["conveyor"\]', dockerfile, re.M)  # exec form: gets SIGTERM
    assert "model-cache:/cache" in engine["volumes"]


@pytest.mark.slow
def test_engine_command_serves_jobs_and_exits_cleanly_on_sigterm(compose, redis_url, namespace):
    engine = compose["services"]["engine"]
    command = [arg.replace("redis://redis:6379", redis_url) for arg in engine["command"]]
    conveyor = Path(sys.executable).with_name("conveyor")
    env = {**os.environ, **{k: str(v) for k, v in engine["environment"].items()},
           "CONVEYOR_NAMESPACE": namespace, "CONVEYOR_MAX_NUM_SEQS": "8"}
    process = subprocess.Popen([str(conveyor), *command], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        client = Client(redis_url, namespace=namespace)
        job = client.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        result = job.result(timeout=120)
        assert result.text and result.finish_reason in ("stop", "length")
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, output[-2000:]
    assert "serving model" in output
