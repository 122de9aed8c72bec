"""Resume, not rerun (issue 43, actors/resume.py): real `conveyor serve` replicas on the
session's Valkey; a replica is SIGKILLed, or SIGTERMed past its grace period, in the middle
of long jobs, and another one continues them from the tokens they already published."""

from __future__ import annotations

import pytest
from fault_harness import JobLedger, pending_owners, spawner_fixture, start_all, wait_until
from model_factory import build_tiny_model

from conveyor.clients import Client
from conveyor.clients.keys import Keys
from conveyor.engine import LLM, SamplingParams

LEASE_S = 2.0
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny Llama with room for 1,500-token outputs."""
    return build_tiny_model("llama", tmp_path_factory.mktemp("resume_llama"), max_position_embeddings=2048)


@pytest.fixture
def spawn(request, tmp_path, redis_url, namespace):
    yield from spawner_fixture(request, tmp_path, redis_url)


def long_job(max_tokens: int = 1500, **more) -> dict:
    return {"prompt_token_ids": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **more}


def assembled(client: Client, job_id: str) -> list[int]:
    """The output as a streaming reader holds it at the end (reruns restart it, resumed attempts continue it)."""
    token_ids: list[int] = []
    for event in client.job(job_id).stream(timeout=10):
        _, token_ids, _ = event.carried_over("", token_ids)
        token_ids = token_ids + list(event.token_ids)
    return token_ids


def published(ledger, job_id: str) -> int:
    return sum(len(e.token_ids) for e in ledger.record(job_id).tokens)


def kill_owner_after(raw, namespace, replicas, ledger, job_id: str, tokens: int):
    wait_until(lambda: published(ledger, job_id) >= tokens, 90, f"{tokens} tokens of {job_id}")
    owners = set(pending_owners(raw, namespace).values())
    victim = next(r for r in replicas if r.consumer in owners)
    assert victim.kill9() == -9
    return victim


def published_by(ledger, job_id: str, attempt: int) -> int:
    return sum(len(e.token_ids) for e in ledger.record(job_id).tokens_of(attempt))


def test_a_job_killed_past_40_percent_resumes_on_another_replica(spawn, long_model, redis_url, namespace, raw):
    pair = start_all([spawn(namespace, f"resume-{n}", long_model, lease_s=LEASE_S) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    job = client.submit(**long_job())
    kill_owner_after(raw, namespace, pair, ledger, job.job_id, 600)
    result = job.result(timeout=180)

    with LLM(long_model, num_kv_blocks=256) as llm:
        [offline] = llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=1500, ignore_eos=True), use_tqdm=False
        )
    assert result.attempt == 2 and result.token_ids == list(offline.outputs[0].token_ids)
    assert result.text == offline.outputs[0].text
    assert result.resumed_tokens >= 600  # at least 40% of the output carried over
    assert published_by(ledger, job.job_id, 2) == 1500 - result.resumed_tokens  # only the rest was decoded
    assert assembled(client, job.job_id) == result.token_ids  # every token once, in order
    note = raw.hget(Keys(namespace).job(job.job_id), "resume:2").decode()
    assert note.startswith(f"resumed after {result.resumed_tokens} of "), note


def test_a_seeded_sampled_job_resumes_to_the_same_text(spawn, long_model, redis_url, namespace, raw):
    pair = start_all([spawn(namespace, f"seeded-{n}", long_model, lease_s=LEASE_S) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    sampled = long_job(max_tokens=900, temperature=0.8, seed=4242, repetition_penalty=1.1)
    untouched = client.submit(**sampled).result(timeout=120)
    job = client.submit(**sampled)
    kill_owner_after(raw, namespace, pair, ledger, job.job_id, 300)
    result = job.result(timeout=180)
    assert result.attempt == 2 and result.resumed_tokens >= 300
    assert result.token_ids == untouched.token_ids and result.text == untouched.text


def test_resuming_is_refused_for_an_other_model(spawn, long_model, tiny_model, redis_url, namespace, raw):
    """A job whose first attempt ran another model (served under the same name) reruns, with
    the reason on its record (tests/test_resume_checks.py: every other refusal)."""
    name = "shared-name"
    first = start_all(
        [spawn(namespace, "other-model", tiny_model, lease_s=LEASE_S, args=["--served-model-name", name])]
    )[0]
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    job = client.submit(**long_job(max_tokens=400))
    wait_until(lambda: published(ledger, job.job_id) >= 50, 60, "tokens from the first model")
    first.kill9()
    start_all([spawn(namespace, "long-model", long_model, lease_s=LEASE_S, args=["--served-model-name", name])])
    result = job.result(timeout=120)
    assert result.attempt == 2 and result.resumed_tokens == 0
    note = raw.hget(Keys(namespace).job(job.job_id), "resume:2").decode()
    assert note.startswith("rerun from the start: the earlier attempt ran"), note
    assert assembled(client, job.job_id) == result.token_ids  # the rerun restarted the output


@pytest.mark.slow
def test_a_rolling_update_past_the_grace_period_costs_no_recomputation(spawn, long_model, redis_url, namespace, raw):
    """SIGTERM with a short grace period to one of two replicas under a batch of long jobs:
    its running jobs are handed back with their progress and finish once on the other, and
    the tokens decoded in all stay within 10% of the jobs' outputs (resumes recompute none)."""
    pair = start_all([spawn(namespace, f"roll-{n}", long_model, lease_s=LEASE_S, grace_s=0.5) for n in "ab"])
    client, ledger = Client(redis_url, namespace=namespace), JobLedger(raw, namespace)
    jobs = [client.submit(**long_job(max_tokens=600, prompt_token_ids=[5, 6, 7, 8 + i])) for i in range(6)]
    wait_until(lambda: sum(published(ledger, j.job_id) for j in jobs) >= 1200, 90, "the batch to be underway")
    owners = list(pending_owners(raw, namespace).values())
    updated = max(pair, key=lambda r: owners.count(r.consumer))  # the one holding jobs (often all six)
    updated.sigterm()
    assert updated.wait(30) == 0, updated.log_tail()
    results = [job.result(timeout=240) for job in jobs]
    assert all(len(r.token_ids) == 600 for r in results)
    assert ledger.summary([j.job_id for j in jobs])["lost"] == 0
    decoded = sum(published_by(ledger, j.job_id, a) for j in jobs for a in (1, 2, 3))
    assert decoded <= 1.10 * 6 * 600, decoded
    assert any(r.resumed_tokens > 0 for r in results)  # the handed-back ones continued
    for job, result in zip(jobs, results):
        assert assembled(client, job.job_id) == result.token_ids
