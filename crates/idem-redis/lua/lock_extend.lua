-- idem lock: compare-and-extend on the owner token.
-- KEYS[1] the lock   ARGV[1] owner token   ARGV[2] ttl (ms)
-- Returns the new lease end (ms since the epoch, server clock), or -1 when
-- the lock is not (or no longer) held by this owner.
local lock, owner, ttl = KEYS[1], ARGV[1], tonumber(ARGV[2])
if redis.call('GET', lock) ~= owner then
  return -1
end
redis.call('PEXPIRE', lock, ttl)
local t = redis.call('TIME')
return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + ttl
