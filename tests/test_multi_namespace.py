"""One replica, several namespaces (issue 41): each namespace keeps its own streams, records,
usage and dead letters, job ids never collide between them, and the engine is shared by
token-weighted fair share: a namespace that floods the queue cannot take another's share."""

import datetime
import time

import pytest
from fault_harness import wait_until
from model_factory import MAX_POSITIONS
from replica_harness import ReplicaThread
from usage_days import usage_since

from conveyor.actors.cli import namespace_users, served_shares
from conveyor.actors.config import ReplicaConfig
from conveyor.clients import Client

TODAY = datetime.datetime.now(datetime.timezone.utc).date()
LONG = MAX_POSITIONS - 8  # as long as the tiny model takes: still running when the grace period ends


def test_each_namespace_keeps_its_own_jobs_records_and_usage(tiny_model, redis_url, namespace):
    a, b = f"{namespace}-a", f"{namespace}-b"
    with ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4) as running:
        assert [door.config.namespace for door in running.replica.doors] == [a, b]
        clients = {ns: Client(redis_url, namespace=ns) for ns in (a, b)}
        try:
            params = dict(prompt_token_ids=[5, 6, 7, 8, 9], temperature=0)
            # the same job id in both namespaces: two jobs, each run and answered in its own
            same_a = clients[a].submit(job_id="same", max_tokens=3, **params)
            same_b = clients[b].submit(job_id="same", max_tokens=5, **params)
            ra, rb = same_a.result(timeout=60), same_b.result(timeout=60)
            assert (ra.usage.completion_tokens, rb.usage.completion_tokens) == (3, 5)
            assert rb.token_ids[:3] == ra.token_ids
            usage = {ns: usage_since(c.redis, c.keys, TODAY)[0] for ns, c in clients.items()}
            assert [(r.jobs, r.completion_tokens) for r in usage[a]] == [(1, 3)]
            assert [(r.jobs, r.completion_tokens) for r in usage[b]] == [(1, 5)]
            assert clients[a].queue_status()["namespace"] == a
            metrics, model = running.replica.metrics.registry, running.replica.model_name
            for ns, completion in ((a, 3), (b, 5)):  # Prometheus, per namespace and model
                labels = {"namespace": ns, "model": model}  # counted just after the result is stored
                wait_for(lambda: metrics.get_sample_value("conveyor_tenant_jobs_total", labels) == 1, "the counter")
                tokens = metrics.get_sample_value("conveyor_tenant_tokens_total", {**labels, "kind": "completion"})
                assert tokens == completion
        finally:
            for client in clients.values():
                client.close()


def test_a_flood_in_one_namespace_does_not_take_the_others_share(tiny_model, redis_url, namespace):
    """a floods 60 long jobs, then b submits 10: while both are backlogged (b has jobs waiting
    in the engine; a always has) b is served at least 40% of the tokens, and all of b's jobs
    finish before a's backlog drains."""
    a, b = f"{namespace}-a", f"{namespace}-b"
    job = dict(max_tokens=24, temperature=0, ignore_eos=True)
    with ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4) as running:
        scheduler = running.engine.scheduler
        ca, cb = Client(redis_url, namespace=a), Client(redis_url, namespace=b)
        try:
            flood = [ca.submit(prompt_token_ids=[5 + i % 40] * 20, **job) for i in range(60)]
            wait_for(lambda: scheduler.fair.served[a] >= 200, "a to be served")
            late = [cb.submit(prompt_token_ids=[7 + i] * 20, **job) for i in range(10)]
            window = backlogged_window(scheduler, b, late[-1])
            a_unfinished = sum(ca.job(h.job_id).status().status not in ("done", "error") for h in flood)
            for handle in late + flood:
                handle.result(timeout=240)
        finally:
            ca.close(), cb.close()
    share_b = window[b] / (window[a] + window[b])
    print(
        f"\nb's share while both were backlogged: {share_b:.2f} ({window}); a's jobs unfinished after b's: {a_unfinished}"
    )
    assert share_b >= 0.4 and a_unfinished > 0


def wait_for(condition, what: str) -> None:
    wait_until(condition, 60, what, interval=0.002)


def backlogged_window(scheduler, tenant: str, last_job) -> dict:
    """Tokens served to each tenant from the first to the last moment ``tenant`` had a job
    waiting in the engine (polled from this thread; the engine steps on its own), once
    ``last_job`` finished."""

    def waiting() -> bool:
        return any(seq.tenant == tenant for seq in list(scheduler.waiting))

    wait_for(waiting, f"{tenant}'s jobs to reach the engine")
    start = dict(scheduler.fair.served)
    end = start
    while last_job.status().status not in ("done", "error"):
        if waiting():
            end = dict(scheduler.fair.served)
        time.sleep(0.002)
    return {t: end.get(t, 0) - start.get(t, 0) for t in set(start) | set(end)}


def test_namespaces_and_shares_are_checked():
    with pytest.raises(ValueError, match="each served once"):
        ReplicaConfig(redis_url="redis://127.0.0.1", namespace="a", more_namespaces=("a",))
    assert served_shares(["a=3"], ["a", "b"]) == {"a": 3.0}
    with pytest.raises(ValueError, match="'c' is not a served namespace"):
        served_shares(["c=2"], ["a", "b"])
    with pytest.raises(ValueError, match="NAMESPACE=USERNAME:PASSWORD_FILE"):
        namespace_users(["a=user-without-file"])


def test_a_stopping_replica_hands_back_every_namespaces_jobs(tiny_model, redis_url, namespace):
    """SIGTERM past the grace period: the running jobs of both namespaces go back to their own
    queues, and the next replica of both finishes them."""
    a, b = f"{namespace}-a", f"{namespace}-b"
    job = dict(prompt_token_ids=[5, 6, 7], max_tokens=LONG, temperature=0, ignore_eos=True)
    first = ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4, consumer="first")
    first.config.grace_s = 0.2
    clients = {ns: Client(redis_url, namespace=ns) for ns in (a, b)}
    try:
        with first:
            handles = {ns: [c.submit(**job) for _ in range(2)] for ns, c in clients.items()}
            wait_for(lambda: len(first.engine.scheduler.running) == 4, "all four jobs to run")
        assert first.exit_code == 0
        statuses = {ns: [clients[ns].job(h.job_id).status().status for h in hs] for ns, hs in handles.items()}
        assert statuses == {a: ["queued"] * 2, b: ["queued"] * 2}, "handed back to their own namespaces"
        with ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4, consumer="second"):
            results = {ns: [h.result(timeout=240) for h in hs] for ns, hs in handles.items()}
    finally:
        for client in clients.values():
            client.close()
    assert all(r.attempt == 2 and len(r.token_ids) == LONG for rs in results.values() for r in rs)


def test_namespaces_on_one_replica_never_share_prefix_cache_blocks(tiny_model, redis_url, namespace):
    """The same long prompt in a, then b, then a again: b reads nothing from the cache (its
    blocks are salted with its namespace), the second job of a reads its prefix."""
    a, b = f"{namespace}-a", f"{namespace}-b"
    prompt = dict(prompt_token_ids=list(range(5, 205)), max_tokens=2, temperature=0)
    with ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4):
        ca, cb = Client(redis_url, namespace=a), Client(redis_url, namespace=b)
        try:
            first_a = ca.submit(**prompt).result(timeout=60)
            only_b = cb.submit(**prompt).result(timeout=60)
            second_a = ca.submit(**prompt).result(timeout=60)
        finally:
            ca.close(), cb.close()
    assert (first_a.usage.cached_tokens, only_b.usage.cached_tokens) == (0, 0)
    assert second_a.usage.cached_tokens > 0
    assert first_a.token_ids == only_b.token_ids == second_a.token_ids


def test_shares_weigh_two_backlogged_namespaces(tiny_model, redis_url, namespace):
    """--share a=3: while both namespaces are backlogged a is served 3/4 of the tokens (0.65
    to 0.85: the running batch's jobs, admitted before, finish at their own pace)."""
    a, b = f"{namespace}-a", f"{namespace}-b"
    job = dict(max_tokens=24, temperature=0, ignore_eos=True)
    with ReplicaThread(tiny_model, redis_url, a, more_namespaces=(b,), max_num_seqs=4, tenant_shares={a: 3}) as running:
        scheduler = running.engine.scheduler
        ca, cb = Client(redis_url, namespace=a), Client(redis_url, namespace=b)
        try:
            handles = [c.submit(prompt_token_ids=[5 + i % 40] * 20, **job) for i in range(30) for c in (ca, cb)]
            wait_for(lambda: any(s.tenant == b for s in list(scheduler.waiting)), "both to wait")
            start = dict(scheduler.fair.served)
            wait_for(lambda: sum(scheduler.fair.served.values()) - sum(start.values()) >= 1200, "1200 tokens")
            waiting = {s.tenant for s in list(scheduler.waiting)}
            served = {ns: scheduler.fair.served[ns] - start.get(ns, 0) for ns in (a, b)}
            for handle in handles:
                handle.result(timeout=240)
        finally:
            ca.close(), cb.close()
    assert waiting == {a, b}, "both still backlogged at the end of the window"
    share_a = served[a] / (served[a] + served[b])
    print(f"\na's share with share 3 of 4: {share_a:.2f} ({served})")
    assert 0.65 <= share_a <= 0.85


def test_each_namespace_connects_as_its_own_acl_user(tiny_model, tmp_path, namespace):
    """--namespace-user: a replica of two namespaces whose Redis users may each touch one
    namespace alone serves both without a denied command (ACL LOG)."""
    from test_security_auth import replica_acl

    from conveyor.actors.embedded_valkey import EmbeddedValkey
    from conveyor.clients.connection import RedisSettings

    a, b = f"{namespace}-a", f"{namespace}-b"
    server = EmbeddedValkey(tmp_path / "acl", password="admin-secret").start()
    try:
        admin = server.settings.client()
        for user, ns in (("rep-a", a), ("rep-b", b)):
            admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{user}-pw", *replica_acl(ns))
        replica = ReplicaThread(tiny_model, server.url, a, more_namespaces=(b,), max_num_seqs=4)
        replica.config.redis = RedisSettings(url=server.url, username="rep-a", password="rep-a-pw")
        replica.config.namespace_users = {b: ("rep-b", "rep-b-pw")}
        with replica:
            for ns in (a, b):
                with Client(namespace=ns, connection=server.settings) as client:
                    assert client.submit(prompt_token_ids=[5, 6, 7], max_tokens=3, temperature=0).result(timeout=60)
        denied = [e for e in admin.acl_log() if e.get("username") in ("rep-a", "rep-b", b"rep-a", b"rep-b")]
        admin.close()
    finally:
        server.stop()
    assert denied == []
    with pytest.raises(ValueError, match="'c' is not a served namespace"):
        ReplicaConfig(redis_url="redis://127.0.0.1", namespace="a", namespace_users={"c": ("u", "p")})
