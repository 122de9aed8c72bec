"""The partition-lease scripts (run by actors/streams.py for the partition keeper,
actors/partitions.py): one hash of leases and one sorted set of takers, both in the
namespace's slot, on the server's clock. Everything they read is producer-writable input:
a value that does not parse, or an expiry further than one lease away, is free, and a key of
the wrong type (a producer's SET on it) is replaced, never fatal (SCRIBBLED_MARK below)."""

# A wrong-typed owners hash or takers zset (found by a probe under pcall: no TYPE command, which
# the documented replica ACL does not grant) is deleted by the claim script, which then answers
# with an error reply starting with this mark and naming the key: the partition keeper logs
# it (rate-limited) and claims again at once, on fresh keys (the deletes are kept: a script's
# writes are not undone by its error reply).
SCRIBBLED_MARK = "SCRIBBLED"  # the claim script's error reply starts with it

# KEYS: partition owners hash, live replicas zset. ARGV: consumer, lease ms, partitions.
# Returns the partitions this consumer owns now, or the SCRIBBLED_MARK error (keys replaced).
CLAIM_PARTITIONS_LUA = """
local scribbled = {}
for i, probe in ipairs({{'HGET', KEYS[1], '0', 'hash'}, {'ZCARD', KEYS[2], 'zset'}}) do
  local reply = redis.pcall(unpack(probe, 1, #probe - 1))
  if type(reply) == 'table' and reply.err then
    if not string.find(reply.err, 'WRONGTYPE', 1, true) then return redis.error_reply(reply.err) end
    redis.call('DEL', KEYS[i])
    scribbled[#scribbled + 1] = KEYS[i] .. ' (not a ' .. probe[#probe] .. ')'
  end
end
if #scribbled > 0 then
  return redis.error_reply('SCRIBBLED replaced ' .. table.concat(scribbled, ', '))
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me, lease, n = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
redis.call('ZADD', KEYS[2], now + lease, me)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '(' .. (now + lease), '+inf')
redis.call('PEXPIRE', KEYS[2], 2 * lease)
local target = math.ceil(n / math.max(1, redis.call('ZCARD', KEYS[2])))
local fields = {}
for p = 0, n - 1 do fields[#fields + 1] = tostring(p) end
local values = redis.call('HMGET', KEYS[1], unpack(fields))
local mine, free = {}, {}
for p = 0, n - 1 do
  local expiry, owner = nil, nil
  if type(values[p + 1]) == 'string' then expiry, owner = string.match(values[p + 1], '^(%d+) (.*)$') end
  expiry = tonumber(expiry)
  if not expiry or expiry <= now or expiry > now + lease then free[#free + 1] = p
  elseif owner == me then mine[#mine + 1] = p end
end
while #mine > target do redis.call('HDEL', KEYS[1], tostring(table.remove(mine))) end
if #free > 0 then
  local start = tonumber(string.sub(redis.sha1hex(me), 1, 6), 16) % #free
  for i = 0, #free - 1 do
    if #mine >= target then break end
    mine[#mine + 1] = free[(start + i) % #free + 1]
  end
end
for _, p in ipairs(mine) do redis.call('HSET', KEYS[1], tostring(p), (now + lease) .. ' ' .. me) end
redis.call('PEXPIRE', KEYS[1], 2 * lease)
return mine
"""

# Leave: give back this consumer's partitions at once. KEYS, ARGV: as above (no lease).
# A wrong-typed key is left alone here (the next claim, anyone's, replaces it).
RELEASE_PARTITIONS_LUA = """
local me, n = ARGV[1], tonumber(ARGV[3])
redis.pcall('ZREM', KEYS[2], me)
for p = 0, n - 1 do
  local value = redis.pcall('HGET', KEYS[1], tostring(p))
  if type(value) == 'table' and value.err then return 0 end
  if type(value) == 'string' and string.match(value, '^%d+ (.*)$') == me then redis.call('HDEL', KEYS[1], tostring(p)) end
end
return 1
"""
