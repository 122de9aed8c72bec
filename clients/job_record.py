"""The job hash ``<ns>:job:<job_id>``: its fields, its statuses, and every script that
writes it. Each status transition has exactly one writer (``TRANSITIONS``); producers'
clients and replicas run these scripts, and nothing else writes a job's status
(tests/test_job_record.py keeps it so). docs/protocol.md describes the fields.

A job hash is producer-writable input: the scripts coerce what they read."""

from dataclasses import dataclass


class Field:
    STATUS = "status"
    ATTEMPT = "attempt"  # 0 while queued, then one more per delivery
    UPDATED = "updated"  # epoch seconds of the last status change
    DIGEST = "digest"  # payload digest: the same id with another payload is a conflict
    ENTRY = "entry"  # the request entry the job runs from (another one is a duplicate)
    RESULT = "result"  # the terminal event's msgpack, once finished
    FINISHED_ATTEMPT = "finished_attempt"  # the attempt whose terminal event is stored
    CANCEL = "cancel"  # "1" once cancellation was requested
    REJECTED = "rejected"  # "1" on a refusal record
    PROMPT_HEAD = "prompt_head"  # the prompt's first PROMPT_HEAD_CHARS characters (the job page)
    # per attempt n <= MAX_RECORDED_ATTEMPTS: "replica:<n>", "started:<n>", "trace:<n>"
    REPLICA_OF_ATTEMPT = "replica:{}"
    STARTED_OF_ATTEMPT = "started:{}"
    TRACE_OF_ATTEMPT = "trace:{}"
    MODEL_OF_ATTEMPT = "model:{}"  # what it ran (actors/resume.py model_identity)
    RESUME_OF_ATTEMPT = "resume:{}"  # how it started: resumed after K tokens, or why it reran


PROMPT_HEAD_CHARS = 500
MAX_RECORDED_ATTEMPTS = 32


class Status:
    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    ERROR = "error"
    CANCELLED = "cancelled"
    REJECTED = "rejected"  # a refusal record: no claim on the id


FINAL_STATUSES = frozenset({Status.DONE, Status.ERROR, Status.CANCELLED})
NO_HASH = ""  # the "status" of a job with no hash yet
ANY = "*"


@dataclass(frozen=True)
class Transition:
    script: str  # the name of the script below that makes it
    before: tuple[str, ...]
    after: tuple[str, ...]
    run_by: str


TRANSITIONS = (
    Transition("SUBMIT_LUA", (NO_HASH, Status.REJECTED), (Status.QUEUED,), "producers: clients/client_core.py submit"),
    Transition(
        "START_LUA",
        (NO_HASH, Status.QUEUED, Status.RUNNING, Status.REJECTED),
        (Status.RUNNING,),
        "replica: actors/ingest.py (running -> running: a reclaim, attempt + 1)",
    ),
    Transition("FINISH_LUA", (Status.RUNNING,), tuple(sorted(FINAL_STATUSES)), "replica: actors/publisher.py"),
    Transition("REJECT_LUA", (NO_HASH,), (Status.REJECTED,), "replica: actors/publisher.py (refusals)"),
    Transition("HAND_BACK_LUA", (Status.RUNNING,), (Status.QUEUED,), "replica: actors/ledger.py (shutdown)"),
    Transition("REQUEUE_LUA", (ANY,), (Status.QUEUED,), "operator: clients/dead_letters.py requeue"),
)

# The atomic submit, for every producer (docs/protocol.md prints this text; a test keeps the
# two equal). Enqueue once per job_id (idempotent submit) and only below the queue bound.
# The hash keeps the payload digest (the same id with another payload is a conflict) and
# the entry id (replicas run a job from that entry only; another entry for it is a
# duplicate). A hash with status 'rejected' (a replica's refusal of an unreadable entry)
# is no claim on the id: it and the job's out stream are deleted and the job is enqueued.
# The bound is the smaller of the caller's max_queue_len and the operator's, which replicas
# publish in the limits hash (field max_queue_len); 0, absent or unreadable: no bound.
# KEYS: job hash, request stream, out stream, limits hash.
# ARGV: payload, ttl, now, max_queue_len (0 = none), digest ('' = not computed: not stored,
#       never a conflict), entry field ('data' msgpack, the default, or 'json').
# Returns 1 enqueued, 0 already known (not enqueued again), -2 conflict, -1 queue full at
# the caller's bound, -3 queue full at the operator's bound, -4 the namespace's daily token
# budget is spent (limits field budget_reset_at, epoch seconds, ahead of now by at most the
# day a budget lasts: a value further off is not a replica's, and refuses nothing).
# The PUBLISH on the channel named like the request stream wakes the replica that owns the
# stream's partition (it waits there instead of polling: actors/partitions.py).
SUBMIT_LUA = """
local field = ARGV[6] or 'data'
if field ~= 'data' and field ~= 'json' then return redis.error_reply('ERR entry field must be data or json') end
local rejected = false
if redis.call('EXISTS', KEYS[1]) == 1 then
  if redis.call('HGET', KEYS[1], 'status') ~= 'rejected' then
    local digest = redis.call('HGET', KEYS[1], 'digest')
    if digest and ARGV[5] ~= '' and digest ~= ARGV[5] then return -2 end
    return 0
  end
  rejected = true
end
local limits = redis.pcall('HMGET', KEYS[4], 'budget_reset_at', 'max_queue_len')
if limits.err then limits = {} end
local resets_at, now = tonumber(limits[1]) or 0, tonumber(ARGV[3])
if resets_at > now and resets_at <= now + 86400 then return -4 end
local limit, full = tonumber(ARGV[4]) or 0, -1
local operator = tonumber(limits[2]) or 0
if operator > 0 and (limit <= 0 or operator < limit) then limit, full = operator, -3 end
if limit > 0 and redis.call('XLEN', KEYS[2]) >= limit then return full end
if rejected then redis.call('DEL', KEYS[1], KEYS[3]) end
local entry = redis.call('XADD', KEYS[2], '*', field, ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'queued', 'attempt', '0', 'updated', ARGV[3], 'entry', entry)
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'digest', ARGV[5]) end
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('PUBLISH', KEYS[2], '')
return 1
"""

# Flag and announce a cancellation only for a job that exists and has not finished.
# KEYS: job hash. ARGV: cancel channel, job id. Returns 1 when requested, else 0.
CANCEL_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status or status == 'done' or status == 'error' or status == 'cancelled' or status == 'rejected' then
  return 0
end
redis.call('HSET', KEYS[1], 'cancel', '1')
redis.call('PUBLISH', ARGV[1], ARGV[2])
return 1
"""

# Start an attempt: count the delivery, unless this entry is a second submission of a job
# that already has one, or of a job that already finished (e.g. reclaimed just before its
# owner's finish acked it): a duplicate, not run again; another payload: a conflict.
# A refusal record (status 'rejected', left by an unreadable entry) is no claim: replaced.
# A digest that is not 64 hex digits (the 32-digit form before 0.2, or junk) is not compared.
# KEYS: job hash, out stream. ARGV: entry id, ttl, now, payload digest[, replica, producer's
# trace id, prompt head, new trace id, model identity] (for the dashboard's job page: where and
# when each of the first 32 attempts ran, the prompt cut, and the attempt's trace: the producer's
# for a first attempt, else the one a tracing replica starts, '' when none; and what model it
# ran, which a later attempt must match to resume from its tokens: actors/resume.py). Returns {attempt, cancel flag} or {-1 duplicate | -2 conflict, ''}.
START_LUA = """
local state = redis.call('HMGET', KEYS[1], 'entry', 'digest', 'cancel', 'finished_attempt', 'status', 'attempt')
if state[5] == 'rejected' then
  redis.call('DEL', KEYS[1], KEYS[2])
  state = {false, false, false, false, false, false}
end
if state[2] and #state[2] == 64 and state[2] ~= ARGV[4] then return {-2, ''} end
if state[1] and state[1] ~= ARGV[1] then return {-1, ''} end
if state[4] then return {-1, ''} end
local attempt = tonumber(state[6])
if not attempt or attempt ~= attempt or attempt < 0 or attempt > 1e9 then attempt = 0 end
attempt = math.floor(attempt) + 1
redis.call('HSET', KEYS[1], 'attempt', attempt, 'status', 'running', 'updated', ARGV[3], 'entry', ARGV[1],
           'digest', ARGV[4])
if ARGV[5] and attempt <= 32 then
  redis.call('HSET', KEYS[1], 'replica:' .. attempt, ARGV[5], 'started:' .. attempt, ARGV[3], 'prompt_head', ARGV[7])
  local trace = ARGV[6]
  if attempt > 1 or trace == '' then trace = ARGV[8] or '' end
  if trace ~= '' then redis.call('HSET', KEYS[1], 'trace:' .. attempt, trace) end
  if ARGV[9] then redis.call('HSET', KEYS[1], 'model:' .. attempt, ARGV[9]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {attempt, state[3] or ''}
"""

# Terminal event + status + ack, only while this replica's attempt is the latest (fencing:
# a stale owner whose job was reclaimed must not publish a final result over the new one).
# Idempotent: a retry after a lost reply does not add a second terminal event.
# Usage: with KEYS[4] (the day's usage hash in the job's slot), the pairs ARGV[10..] (field,
# count) are added to it when the job finishes for the first time (a retry, or a reclaimed
# attempt whose earlier one finished, counts nothing), ARGV[9] its TTL; a key of another
# type is reset and a field that is not a number restarts (producers can write the namespace).
# HGET and HSET rather than HINCRBY: the replica's ACL (docs/security.md) needs no new command.
# KEYS: job hash, out stream, request stream[, usage hash]. ARGV: attempt, status, type, data,
# ttl, group, entry id, now[, usage ttl, field, count, ...]. Returns 1 when written, 0 when
# fenced off.
FINISH_LUA = """
local current = tonumber(redis.call('HGET', KEYS[1], 'attempt')) or 0
if current > tonumber(ARGV[1]) then return 0 end
local finished = redis.call('HGET', KEYS[1], 'finished_attempt')
if finished ~= ARGV[1] then
  redis.call('XADD', KEYS[2], '*', 'type', ARGV[3], 'data', ARGV[4])
end
if KEYS[4] and not finished then
  for i = 10, #ARGV, 2 do
    local count = redis.pcall('HGET', KEYS[4], ARGV[i])
    if type(count) == 'table' and count.err then
      redis.call('DEL', KEYS[4])
      count = false
    end
    count = tonumber(count) or 0
    if count ~= count or count < 0 or count >= 2^53 then count = 0 end  -- nan, inf, negative: restart
    count = count + tonumber(ARGV[i + 1])
    redis.call('HSET', KEYS[4], ARGV[i], string.format('%d', count))
  end
  redis.call('EXPIRE', KEYS[4], ARGV[9])
end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'result', ARGV[4], 'updated', ARGV[8],
           'finished_attempt', ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[5])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('XACK', KEYS[3], ARGV[6], ARGV[7])
redis.call('XDEL', KEYS[3], ARGV[7])
return 1
"""

# Tell the producer of an unreadable entry why it was refused, without touching any job:
# only where no record of that id exists (no hash, no out stream). The hash is marked
# 'rejected' so a later valid submission of the id replaces it (SUBMIT_LUA, START_LUA).
# KEYS: job hash, out stream. ARGV: entry id, event data, ttl, now. Returns 1 or 0.
REJECT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 or redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
redis.call('XADD', KEYS[2], '*', 'type', 'error', 'data', ARGV[2])
redis.call('HSET', KEYS[1], 'status', 'rejected', 'rejected', '1', 'entry', ARGV[1], 'result', ARGV[2],
           'updated', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return 1
"""

# Shutdown: give an unfinished job back to the queue, only while its hash still says this
# replica's attempt of this entry is running (a newer owner's record is left alone).
# KEYS: job hash. ARGV: attempt, entry id, now. Returns 1 when handed back, else 0.
HAND_BACK_LUA = """
local state = redis.call('HMGET', KEYS[1], 'status', 'attempt', 'entry')
if state[1] ~= 'running' or tonumber(state[2]) ~= tonumber(ARGV[1]) or state[3] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', 'queued', 'updated', ARGV[3])
return 1
"""

# Requeue a dead letter: its fields go back on its request stream as a new entry, with a
# fresh delivery budget; a job hash that exists names the new entry. None is created here
# (the replica creates it, with a TTL), and a key that is not a hash is left alone.
# KEYS: request stream, dead stream, job hash (optional). In the partitioned layout the dead
# stream lives in another slot than the request stream: KEYS[2] is then the request stream
# again, and the caller deletes the letter afterwards (a letter requeued twice after a crash
# in between runs once: the second entry is a duplicate). ARGV: dead letter id, now,
# field, value, ... (at most MAX_REQUEUE_FIELDS pairs: Lua's unpack has a bound). Returns
# the new entry id.
MAX_REQUEUE_FIELDS = 3000
REQUEUE_LUA = """
if #ARGV - 2 > 2 * %d then return redis.error_reply('ERR fields: more than %d, too many to requeue') end
local entry = redis.call('XADD', KEYS[1], '*', unpack(ARGV, 3))
if KEYS[2] ~= KEYS[1] then redis.call('XDEL', KEYS[2], ARGV[1]) end
if KEYS[3] and redis.call('TYPE', KEYS[3]).ok == 'hash' then
  redis.call('HDEL', KEYS[3], 'finished_attempt')
  redis.call('HSET', KEYS[3], 'status', 'queued', 'attempt', '0', 'updated', ARGV[2], 'entry', entry)
end
return entry
""" % (MAX_REQUEUE_FIELDS, MAX_REQUEUE_FIELDS)
