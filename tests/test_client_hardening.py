"""Client hardening (issue 39), each against what an attacker can plant, on a real Valkey:

- a chat template in the model info that renders no more than the messages' own text is not
  trusted to size a job (the gateway's default max_tokens would overrun the replica's count);
- a forged dead letter never brings a finished job back to `queued` (the requeue script
  checks the job hash's status in the same atomic step);
- a data folder (`url`, `password`) that is not the user's own, or that others may write,
  is refused with the path and what is wrong: a fake server never gets the password, while
  `conveyor serve`'s own embedded Valkey keeps working;
- a sync Client shared by more threads than its pool holds makes them wait, never raises
  "Too many connections" (redis-py 8 pools raise past 100).
"""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import msgpack
import pytest
import redis

from conveyor.actors.embedded_valkey import EmbeddedValkey
from conveyor.clients import Client
from conveyor.clients.connection import SYNC_POOL_SIZE, RedisSettings, resolve_settings
from conveyor.clients.dead_letters import list_dead, requeue, requeue_async
from conveyor.clients.events import CancelledEvent, DoneEvent, ErrorEvent, encode_event
from conveyor.clients.job_record import FINISH_LUA, START_LUA
from conveyor.clients.keys import Keys
from conveyor.clients.local_server import UnsafeDataDir, find_local_server
from conveyor.clients.model_info import ModelInfo
from conveyor.clients.token_counter import RenderRefused, message_text

# ------------------------------------------------------------------ 10a: planted chat templates

CHATS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "user", "content": "What is a queue?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Summarize: queues are nice."}],
    [
        {"role": "user", "content": "Two turns"},
        {"role": "assistant", "content": "Sure."},
        {"role": "user", "content": "Ünïcode ✓ and   spaces\n\n\tand tabs"},
    ],
    [{"role": "user", "content": "x" * 3000}],
]
# each renders the conversation's text and nothing else, or less: as few tokens as the text
PLANTED = {
    "content only": "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "content, trimmed": "{% for m in messages %}{{ m['content'][2:] }}{% endfor %}",
    "first message only": "{{ messages[0]['content'] }}",
}


@pytest.fixture(scope="module")
def smollm2():
    from transformers import AutoTokenizer

    from conveyor.engine.models.loader import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2"))
    return tokenizer, ModelInfo.from_hf_tokenizer("smollm2", 8192, {2}, tokenizer)


@pytest.mark.parametrize("chat", CHATS)
def test_the_served_template_is_trusted_and_counts_exactly(smollm2, chat):
    tokenizer, info = smollm2
    expected = tokenizer.apply_chat_template(chat, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert info.token_counter().checked_count_chat(chat) == len(expected)


@pytest.mark.parametrize("name", sorted(PLANTED))
@pytest.mark.parametrize("chat", CHATS)
def test_a_planted_template_no_longer_than_the_text_is_not_trusted(smollm2, name, chat):
    """Before: trusted down to 2 tokens per message under the text, so the gateway gave a
    chat without max_tokens `max_model_len - count`, over the context the replica (rendering
    its own template, which adds the role markup) finds: the job was refused (400)."""
    _, info = smollm2
    served, planted = info.token_counter(), ModelInfo(**{**vars(info), "chat_template": PLANTED[name]}).token_counter()
    assert planted.count_chat(chat) < served.count_chat(chat)  # what made the default overrun the context
    with pytest.raises(RenderRefused, match="not trusted for counting"):
        planted.checked_count_chat(chat)


def test_a_message_of_parts_counts_the_text_of_its_parts():
    parts = [
        {"type": "text", "text": "parts: "},
        {"type": "image_url", "image_url": {"url": "x"}},
        {"type": "text", "text": "2"},
    ]
    assert message_text(parts) == "parts: 2" and message_text(None) == "" and message_text("plain") == "plain"


# ------------------------------------------------------------------ 10c: forged dead letters


def finished(raw, keys: Keys, job_id: str, status: str, event) -> None:
    """A job's hash as a replica leaves it: started from entry 1-1, then finished."""
    assert raw.eval(START_LUA, 2, keys.job(job_id), keys.out(job_id), "1-1", 600, "0", "")[0] == 1
    data = encode_event(event)
    assert raw.eval(
        FINISH_LUA, 3, keys.job(job_id), keys.out(job_id), keys.interactive, 1, status, event.type, data["data"],
        600, "engines", "1-1", "1",
    ) == 1  # fmt: skip


def forged(raw, keys: Keys, job_id: str) -> str:
    payload = msgpack.packb({"job_id": job_id, "prompt": "again", "max_tokens": 2})
    letter = {
        "stream": keys.interactive,
        "entry_id": "1-1",
        "reason": "forged",
        "job_id": job_id,
        "field:data": payload,
    }
    return raw.xadd(keys.dead, letter).decode()


FINISHED_JOBS = {
    "done": DoneEvent(attempt=1, token_ids=[5], finish_reason="length"),
    "cancelled": CancelledEvent(attempt=1),
    "error": ErrorEvent(attempt=1, code="invalid_request", message="max_tokens: too large"),
}


@pytest.mark.parametrize("status", sorted(FINISHED_JOBS))
def test_a_forged_letter_never_requeues_a_finished_job(redis_url, raw, namespace, status, capsys):
    from conveyor.cli import main

    keys = Keys(namespace)
    finished(raw, keys, "victim", status, FINISHED_JOBS[status])
    before = raw.hgetall(keys.job("victim"))
    dead_id = forged(raw, keys, "victim")
    new_ids, skipped, failed = requeue(raw, keys)
    assert new_ids == [] and skipped == []
    assert [(letter.dead_id, why) for letter, why in failed] == [
        (dead_id, f"job 'victim' is {status}: a finished job is never requeued")
    ]
    assert raw.hgetall(keys.job("victim")) == before  # still finished, same entry, same result
    assert raw.xlen(keys.interactive) == 0 and [d.dead_id for d in list_dead(raw, keys)] == [dead_id]
    assert main(["dead", "requeue", "--redis-url", redis_url, "--namespace", namespace]) == 1
    assert "a finished job is never requeued" in capsys.readouterr().out
    assert raw.hget(keys.job("victim"), "status") == status.encode()


def test_the_async_requeue_keeps_the_same_rule(redis_url, raw, namespace):
    import asyncio

    import redis.asyncio as aioredis

    keys = Keys(namespace)
    finished(raw, keys, "victim", "done", FINISHED_JOBS["done"])
    forged(raw, keys, "victim")

    async def run():
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await requeue_async(client, keys)
        finally:
            await client.aclose()

    new_ids, _, failed = asyncio.run(run())
    assert new_ids == [] and len(failed) == 1 and raw.hget(keys.job("victim"), "status") == b"done"


def test_a_job_parked_after_max_deliveries_is_still_requeued(raw, namespace):
    """The one final status a dead letter with a payload records, and a requeue may mend."""
    keys = Keys(namespace)
    parked = ErrorEvent(attempt=1, code="max_deliveries", message="delivered 4 times (max_deliveries=3)")
    finished(raw, keys, "unlucky", "error", parked)
    forged(raw, keys, "unlucky")
    new_ids, skipped, failed = requeue(raw, keys)
    assert len(new_ids) == 1 and not skipped and not failed
    assert raw.hmget(keys.job("unlucky"), "status", "entry") == [b"queued", new_ids[0].encode()]


def test_a_junk_result_is_not_taken_for_max_deliveries(raw, namespace):
    keys = Keys(namespace)
    finished(raw, keys, "victim", "error", FINISHED_JOBS["error"])
    for junk in (b"\xc1 not msgpack", msgpack.packb("max_deliveries"), msgpack.packb({"code": ["max_deliveries"]})):
        raw.hset(keys.job("victim"), "result", junk)
        forged(raw, keys, "victim")
        assert requeue(raw, keys)[0] == []
    assert raw.hget(keys.job("victim"), "status") == b"error"


# ------------------------------------------------------------------ 10d: the data folder's files


class FakeServer:
    """A listener that records every byte a client sends (an AUTH carries the password)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.received = b""
        self.listener.settimeout(0.2)
        self.stopped = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopped:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(1.0)
                try:
                    self.received += conn.recv(65536)
                    conn.sendall(b"+OK\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.stopped = True
        self.thread.join(5)
        self.listener.close()


@pytest.fixture
def home(tmp_path, monkeypatch):
    for name in ("REDIS_URL", "REDIS_PASSWORD", "REDIS_PASSWORD_FILE", "REDIS_USERNAME", "CONVEYOR_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    folder = tmp_path / "data"
    folder.mkdir(mode=0o700)
    monkeypatch.setenv("CONVEYOR_DATA_DIR", str(folder))
    return folder


def record(folder, url: str, password: str = "the-real-password") -> None:
    for name, text in (("url", url), ("password", password)):
        path = folder / name
        path.write_text(text + "\n")
        path.chmod(0o600)


@pytest.mark.parametrize(
    "target, mode, problem",
    [
        ("url", 0o666, "writable by its group and everyone (mode 0666)"),
        ("url", 0o620, "writable by its group (mode 0620)"),
        ("password", 0o602, "writable by everyone (mode 0602)"),
        (".", 0o777, "writable by its group and everyone (mode 0777)"),
        (".", 0o1733, "writable by its group and everyone (mode 1733)"),
    ],
    ids=["url-0666", "url-0620", "password-0602", "folder-0777", "folder-1733"],
)
def test_a_data_folder_others_may_write_is_refused(home, target, mode, problem):
    fake = FakeServer()
    try:
        record(home, f"redis://127.0.0.1:{fake.port}")
        path = home if target == "." else home / target
        path.chmod(mode)
        with pytest.raises(UnsafeDataDir) as refused:
            Client(namespace="n").redis.ping()
        assert str(path) in str(refused.value) and problem in str(refused.value)
        with pytest.raises(UnsafeDataDir):
            resolve_settings(url=f"redis://127.0.0.1:{fake.port}")  # its password file: not used either
        time.sleep(0.3)
        assert b"the-real-password" not in fake.received and fake.received == b""
    finally:
        fake.close()


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
@pytest.mark.parametrize("target", ["url", "password", "."])
def test_a_data_folder_or_file_of_another_user_is_refused(home, target):
    record(home, "redis://127.0.0.1:1")
    path = home if target == "." else home / target
    os.chown(path, 65534, 65534)
    with pytest.raises(UnsafeDataDir, match="owned by uid 65534, not by this user"):
        find_local_server(home)


def test_a_fifo_in_place_of_the_url_is_refused_without_hanging(home):
    os.mkfifo(home / "url", 0o600)
    outcome: list[BaseException] = []

    def look() -> None:  # a blocking open of a FIFO never returns: the thread would stay alive
        try:
            find_local_server(home)
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=look, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), "opening the FIFO blocked"
    assert isinstance(outcome[0], UnsafeDataDir) and "not a regular file" in str(outcome[0]), outcome


def test_a_private_folder_is_used_and_a_missing_one_is_no_server(home, tmp_path):
    record(home, "redis://127.0.0.1:6390")
    server = find_local_server(home)
    assert server is not None and server.url == "redis://127.0.0.1:6390" and server.password == "the-real-password"
    assert find_local_server(tmp_path / "nothing") is None


def test_conveyor_serves_embedded_valkey_repairs_a_loose_folder_and_clients_use_it(home):
    """`conveyor serve` makes its folder 0700 and its files 0600 (a folder an older run
    left 0777 included): its clients find it, password and all."""
    home.chmod(0o777)
    server = EmbeddedValkey(home).start()
    try:
        assert stat.S_IMODE(home.stat().st_mode) == 0o700
        assert stat.S_IMODE((home / "url").stat().st_mode) == stat.S_IMODE((home / "password").stat().st_mode) == 0o600
        settings = resolve_settings()
        assert (settings.url, settings.password) == (server.url, server.password)
        with Client(namespace="n") as client:
            assert client.redis.ping()
    finally:
        server.stop()


# ------------------------------------------------------------------ 17: sync pools wait


def blpop_from_threads(client: redis.Redis | redis.RedisCluster, threads_count: int) -> list:
    """`threads_count` threads at once, each holding a connection 0.3 s (a BLPOP on an empty
    list): their replies, or the first errors."""
    start = threading.Barrier(threads_count)
    replies, errors = [], []

    def work(index: int) -> None:
        try:
            start.wait(30)
            replies.append(client.blpop([f"{{pool-test}}-{index}"], 0.3))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(threads_count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors[:3]
    assert not any(thread.is_alive() for thread in threads)
    return replies


THREADS = SYNC_POOL_SIZE + 72  # past redis-py's 100 and past this pool's size


def test_a_sync_client_shared_by_more_threads_than_its_pool_waits(redis_url):
    """Before: redis-py 8's pool raised MaxConnectionsError ("Too many connections") past 100."""
    with Client(redis_url, namespace="pool") as client:
        assert blpop_from_threads(client.redis, THREADS) == [None] * THREADS
        pool = client.redis.connection_pool
    assert isinstance(pool, redis.BlockingConnectionPool) and pool.max_connections == SYNC_POOL_SIZE  # some waited


def test_a_sync_cluster_client_waits_too(tmp_path):
    from cluster_harness import ValkeyCluster

    cluster = ValkeyCluster(tmp_path / "cluster", masters=1, with_replicas=False)
    cluster.start()
    try:
        client = RedisSettings(url=cluster.url, cluster=True).client()
        try:
            assert blpop_from_threads(client, THREADS) == [None] * THREADS
            pools = [node.redis_connection.connection_pool for node in client.get_nodes()]
            assert pools and all(isinstance(pool, redis.BlockingConnectionPool) for pool in pools)
        finally:
            client.close()
    finally:
        cluster.stop()


def test_settings_clients_wait_for_a_free_connection(redis_url):
    sync = RedisSettings(url=redis_url).client(decode_responses=True, single_connection_client=False)
    try:
        assert isinstance(sync.connection_pool, redis.BlockingConnectionPool)
        assert sync.set("pool-settings", "v") and sync.get("pool-settings") == "v"  # options reach it
    finally:
        sync.delete("pool-settings")
        sync.close()
