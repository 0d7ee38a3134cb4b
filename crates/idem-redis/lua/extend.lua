-- extend: move the lease end to now + lease, only while the fence is current.
-- KEYS[1] the record   KEYS[2] the fence counter
-- ARGV[1] fence (decimal)   ARGV[2] lease (ms)   ARGV[3] keep_expired (ms)
-- Returns the new lease end (ms since the epoch), or -1 when the fence is
-- not current.
local rec, fkey = KEYS[1], KEYS[2]
local fence, lease, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if current_fence(rec) ~= fence then
  return -1
end
local now = now_ms_us()
local lease_until = now + lease
local gone_at = lease_until + keep
redis.call('HSET', rec, 'lease_until', int(lease_until))
redis.call('PEXPIREAT', rec, int(gone_at))
keep_fence(fkey, fence, gone_at, keep)
return lease_until
