-- idem lock: acquire. One atomic step on one hash tag.
-- KEYS[1] the lock (a string holding the owner token, with a PX expiry)
-- KEYS[2] the name's fence counter (never expires)
-- ARGV[1] owner token   ARGV[2] ttl (ms)
-- Returns {1, fence, until_ms} when granted, or {0, pttl_ms} when busy.
-- Time is the server's (TIME is allowed in scripts since Redis 5 with
-- effects replication: replicas get the SET … PX, not the script).
local lock, fkey = KEYS[1], KEYS[2]
local owner, ttl = ARGV[1], tonumber(ARGV[2])
local left = redis.call('PTTL', lock)
if left ~= -2 then
  -- -1 (no expiry) cannot come from this script; report a 1 s hint.
  if left < 0 then left = 1000 end
  return {0, left}
end
local fence = redis.call('INCR', fkey)
redis.call('SET', lock, owner, 'PX', ttl)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return {1, fence, now + ttl}
