"""The job-hash schema: each script writes exactly the statuses its transition says, no
other code writes a job's status, and the two newest writers (hand-back, requeue) keep
their fences, against a real Valkey."""

import re
from pathlib import Path

import pytest

from conveyor.clients import job_record
from conveyor.clients.job_record import ANY, FINAL_STATUSES, HAND_BACK_LUA, REQUEUE_LUA, START_LUA, TRANSITIONS, Status
from conveyor.clients.keys import Keys

REPO = Path(__file__).resolve().parents[1]
STATUSES = {value for name, value in vars(Status).items() if not name.startswith("_")}
# 'status', 'queued' in Lua, "status": "queued" in Python: a literal status written to a field named status
STATUS_WRITE = re.compile(r"""['"]status['"]\s*[,:]\s*['"](%s)['"]""" % "|".join(sorted(STATUSES)))


def test_each_script_writes_exactly_the_statuses_of_its_transition():
    for transition in TRANSITIONS:
        script = getattr(job_record, transition.script)
        written = set(STATUS_WRITE.findall(script))
        if transition.script == "FINISH_LUA":  # the status is the caller's: one of the final ones
            assert "'status', ARGV[2]" in script and not written
            assert set(transition.after) == FINAL_STATUSES
        else:
            assert written == set(transition.after), transition.script


def test_one_writer_per_transition():
    pairs = [(before, after) for t in TRANSITIONS if ANY not in t.before for before in t.before for after in t.after]
    assert len(pairs) == len(set(pairs))
    assert [t.script for t in TRANSITIONS if ANY in t.before] == ["REQUEUE_LUA"]  # the operator's reset


def test_no_other_module_writes_a_job_status():
    # the gateway's own batch hashes, and the Responses API's response objects (their own `status`)
    batch_records = {"batch_store.py", "batch_runner.py", "batch_routes.py", "responses.py"}
    for path in [
        *REPO.glob("actors/*.py"),
        *REPO.glob("clients/**/*.py"),
        *REPO.glob("apps/**/*.py"),
        *REPO.glob("gateway/*.py"),
    ]:
        if path.name == "job_record.py" or path.name in batch_records:
            continue
        assert not STATUS_WRITE.search(path.read_text()), f"{path} writes a job status itself"


@pytest.fixture
def keys(namespace):
    return Keys(namespace)


def started(raw, keys, job_id: str, entry_id: str) -> None:
    assert raw.eval(START_LUA, 2, keys.job(job_id), keys.out(job_id), entry_id, 60, "0", "")[0] == 1


def test_hand_back_queues_only_the_attempt_and_entry_that_are_still_ours(raw, keys):
    started(raw, keys, "ours", "1-1")
    assert raw.eval(HAND_BACK_LUA, 1, keys.job("ours"), 1, "1-1", "5") == 1
    assert raw.hmget(keys.job("ours"), "status", "updated") == [b"queued", b"5"]
    started(raw, keys, "newer", "1-2")
    raw.hset(keys.job("newer"), "attempt", 2)  # reclaimed by another replica meanwhile
    assert raw.eval(HAND_BACK_LUA, 1, keys.job("newer"), 1, "1-2", "5") == 0
    started(raw, keys, "other-entry", "1-3")
    assert raw.eval(HAND_BACK_LUA, 1, keys.job("other-entry"), 1, "9-9", "5") == 0
    assert raw.hget(keys.job("newer"), "status") == raw.hget(keys.job("other-entry"), "status") == b"running"
    assert raw.eval(HAND_BACK_LUA, 1, keys.job("gone"), 1, "1-4", "5") == 0 and not raw.exists(keys.job("gone"))


def test_requeue_resets_a_hash_names_the_new_entry_and_creates_nothing(raw, keys):
    dead_id = raw.xadd(keys.dead, {"reason": "x"})
    started(raw, keys, "parked", "1-1")
    raw.hset(keys.job("parked"), mapping={"status": "error", "attempt": 3, "finished_attempt": 3})
    entry = raw.eval(REQUEUE_LUA, 3, keys.interactive, keys.dead, keys.job("parked"), dead_id, "7", "data", b"x")
    assert raw.hmget(keys.job("parked"), "status", "attempt", "entry", "finished_attempt") == [
        b"queued",
        b"0",
        entry,
        None,
    ]
    assert raw.xlen(keys.dead) == 0 and raw.xrange(keys.interactive)[-1] == (entry, {b"data": b"x"})
    raw.eval(REQUEUE_LUA, 3, keys.interactive, keys.dead, keys.job("none"), "0-1", "7", "data", b"y")
    raw.set(keys.job("clobbered"), "a string")
    raw.eval(REQUEUE_LUA, 3, keys.interactive, keys.dead, keys.job("clobbered"), "0-1", "7", "data", b"z")
    assert not raw.exists(keys.job("none")) and raw.get(keys.job("clobbered")) == b"a string"
    assert raw.xlen(keys.interactive) == 3
