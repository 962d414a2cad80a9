"""The Redis limiter's Lua scripts and the keys they read (``gateway.limits.redis_limiter`` says
what they keep and why): the bucket arithmetic of ``gateway.limits.base`` run atomically in Redis,
with the credit lent to replicas, leases and their tombstones. Each reads the clock with Redis
``TIME``; every key of a tenant shares one hash tag (one Redis Cluster slot).
"""

from __future__ import annotations

_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- A bucket's level now: refilled at cap per window since it was stored, up to ceiling (cap less
-- what is lent out); a bucket that is not stored is full.
local function level(key, cap, ceiling, window)
  local v = redis.call('HMGET', key, 'level', 'ts')
  if not v[1] then return ceiling end
  local elapsed = now - tonumber(v[2])
  if elapsed < 0 then elapsed = 0 end
  local lvl = tonumber(v[1]) + elapsed * cap / window
  if lvl > ceiling then lvl = ceiling end
  return lvl
end
local function store(key, lvl, window)
  redis.call('HSET', key, 'level', tostring(lvl), 'ts', now)
  redis.call('PEXPIRE', key, 2 * window)
end
-- Credit lent to replicas: a hash of credit id -> 'requests tokens deadline_ms'. Returns what the
-- live records hold, less the one named `returned`, which is deleted with the expired ones; of
-- that one, at most what it holds of back_r and back_t comes back, and whether it was found
-- (live: a call that gives it back a second time, a replay, finds nothing).
local function lent(key, returned, back_r, back_t)
  local sum_r, sum_t, got_r, got_t, found = 0, 0, 0, 0, false
  local records = redis.call('HGETALL', key)
  for i = 1, #records, 2 do
    local r, k, d = string.match(records[i + 1], '^(%S+) (%S+) (%S+)$')
    r, k, d = tonumber(r), tonumber(k), tonumber(d)
    if d <= now then
      redis.call('HDEL', key, records[i])
    elseif records[i] == returned then
      redis.call('HDEL', key, records[i])
      got_r, got_t, found = math.min(r, back_r), math.min(k, back_t), true
    else
      sum_r, sum_t = sum_r + r, sum_t + k
    end
  end
  return sum_r, sum_t, got_r, got_t, found
end
-- Extends a key's life to at least ms (never shortens what another caller set).
local function keep(key, ms)
  if redis.call('PTTL', key) < ms then redis.call('PEXPIRE', key, ms) end
end
"""

# KEYS: requests bucket, tokens bucket, lease zset, the lease's tombstone, the lent credit.
# ARGV: rpm cap, tpm cap, concurrency cap ('' = no limit), cost, lease id, lease ms, window ms,
# the credit given back (its id, '' = none; its unused requests and tokens), tokens refunded
# (unused completion tokens owed), the new credit's id, the requests and tokens it asks for
# (0 = none), its life in ms.
# Returns {1, rpm level, tpm level, credit requests, credit tokens} admitted (the levels after
# the take, credit excluded), or {0, kind, wait_ms, rpm level, tpm level} (the levels as found;
# wait_ms -1: can never fit; kind 'abandoned': the gateway gave this admit up before it ran). A
# level is a string ('' = no such limit): Redis would truncate a Lua number to an integer.
# Credit is taken only from the upper half of a bucket, and for every limit the plan has or none.
ADMIT_LUA = (
    _PRELUDE
    + """
if redis.call('EXISTS', KEYS[4]) == 1 then return {0, 'abandoned', -1, '', ''} end
local rpm, tpm, conc = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local cost, lease = tonumber(ARGV[4]), ARGV[5]
local lease_ms, window = tonumber(ARGV[6]), tonumber(ARGV[7])
local lent_r, lent_t, back_r, back_t, found = lent(
  KEYS[5], ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10]))
local refund = found and tonumber(ARGV[11]) or 0  -- owed with that credit: once, with it
local want_r, want_t, credit_ms = tonumber(ARGV[13]), tonumber(ARGV[14]), tonumber(ARGV[15])
local rpm_level, tpm_level
if rpm then
  rpm_level = level(KEYS[1], rpm, rpm - lent_r, window)
  if back_r > 0 then
    rpm_level = math.min(rpm - lent_r, rpm_level + back_r)
    store(KEYS[1], rpm_level, window)
  end
end
if tpm then
  tpm_level = level(KEYS[2], tpm, tpm - lent_t, window)
  if back_t + refund > 0 then
    tpm_level = math.min(tpm - lent_t, tpm_level + back_t + refund)
    store(KEYS[2], tpm_level, window)
  end
end
local function levels(r, t)
  return r and tostring(r) or '', t and tostring(t) or ''
end
local seen_r, seen_t = levels(rpm_level, tpm_level)
if tpm and cost > tpm then return {0, 'tokens', -1, seen_r, seen_t} end
if conc then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= conc then return {0, 'concurrency', 1000, seen_r, seen_t} end
end
if rpm and rpm_level < 1 then
  return {0, 'requests', math.ceil((1 - rpm_level) * window / rpm), seen_r, seen_t}
end
if tpm and tpm_level < cost then
  return {0, 'tokens', math.ceil((cost - tpm_level) * window / tpm), seen_r, seen_t}
end
local got_r, got_t = 0, 0
if rpm then
  rpm_level = rpm_level - 1
  got_r = math.max(0, math.min(want_r, math.floor(rpm_level - rpm / 2)))
end
if tpm then
  tpm_level = tpm_level - cost
  got_t = math.max(0, math.min(want_t, math.floor(tpm_level - tpm / 2)))
end
if (rpm and got_r < 1) or (tpm and got_t < 1) then got_r, got_t = 0, 0 end
if got_r + got_t > 0 then
  redis.call('HSET', KEYS[5], ARGV[12], got_r .. ' ' .. got_t .. ' ' .. (now + credit_ms))
  keep(KEYS[5], 2 * credit_ms)  -- another replica's credit may live longer
end
if rpm then store(KEYS[1], rpm_level - got_r, window) end
if tpm then store(KEYS[2], tpm_level - got_t, window) end
if conc then
  redis.call('ZADD', KEYS[3], now + lease_ms, lease)
  redis.call('PEXPIRE', KEYS[3], 2 * lease_ms)
end
local after_r, after_t = levels(rpm and rpm_level - got_r, tpm and tpm_level - got_t)
return {1, after_r, after_t, got_r, got_t}
"""
)

# KEYS: requests bucket, tokens bucket, lease zset, the lease's tombstone, the lent credit.
# ARGV: rpm cap, tpm cap ('' = none), refund, lease id, window ms, tombstone ms, abandoned ('1',
# or '' for a normal release), the credit given back (its id, '' = none; its unused requests and
# tokens). Every release leaves the lease's tombstone: a second run of it (a retry whose first
# reply was lost, a replay) refunds nothing again, and a late admit of it takes nothing. An
# abandoned admit's release refunds only a lease it removed.
RELEASE_LUA = (
    _PRELUDE
    + """
local removed = redis.call('ZREM', KEYS[3], ARGV[4])
local rpm, tpm, refund = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local window = tonumber(ARGV[5])
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', ARGV[6]) then refund = 0 end
if ARGV[7] ~= '' and removed == 0 then refund = 0 end
local lent_r, lent_t, back_r, back_t = lent(KEYS[5], ARGV[8], tonumber(ARGV[9]), tonumber(ARGV[10]))
if rpm and back_r > 0 and redis.call('EXISTS', KEYS[1]) == 1 then
  store(KEYS[1], math.min(rpm - lent_r, level(KEYS[1], rpm, rpm - lent_r, window) + back_r), window)
end
if tpm and back_t + refund > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
  local lvl = level(KEYS[2], tpm, tpm - lent_t, window) + back_t + refund
  store(KEYS[2], math.min(tpm - lent_t, lvl), window)
end
return 1
"""
)

# KEYS: lease zset. ARGV: lease id, lease ms. Extends a lease that still exists.
REFRESH_LUA = (
    _PRELUDE
    + """
return redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[2]), ARGV[1])
"""
)


def keys_of(tenant_id: str, lease_id: str) -> list[str]:
    """A script's keys: the tenant's requests and tokens buckets, its leases, the lease's
    tombstone and the credit lent out (one hash tag: one Redis Cluster slot)."""
    base = f"kvg:lim:{{{tenant_id}}}"
    return [
        f"{base}:requests",
        f"{base}:tokens",
        f"{base}:leases",
        f"{base}:gone:{lease_id}",
        f"{base}:lent",
    ]
