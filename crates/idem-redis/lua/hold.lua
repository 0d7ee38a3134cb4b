-- hold: mark an in-progress record held (its outcome is unknown) and keep
-- it at least hold_for from now, only while the fence is current. The
-- reason goes in the record's `response` field (a completed record's
-- result, an in-progress one's hold reason); `begin` drops it on a takeover.
-- KEYS[1] the record   KEYS[2] the fence counter
-- ARGV[1] fence (decimal)   ARGV[2] hold for (ms)   ARGV[3] keep_expired (ms)
-- ARGV[4] the reason's name
-- Returns the new lease end (ms since the epoch), or -1 when the fence is
-- not current.
local rec, fkey = KEYS[1], KEYS[2]
local fence, hold, keep, reason = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
if current_fence(rec) ~= fence then
  return -1
end
local now = now_ms_us()
local lease_until = math.max(tonumber(redis.call('HGET', rec, 'lease_until')) or 0, now + hold)
local gone_at = lease_until + keep
redis.call('HSET', rec, 'lease_until', int(lease_until), 'response', reason)
redis.call('PEXPIREAT', rec, int(gone_at))
keep_fence(fkey, fence, gone_at, keep)
return lease_until
