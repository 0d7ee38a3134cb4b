-- complete: store the result, only while the caller's fence is current.
-- KEYS[1] the record   KEYS[2] the fence counter
-- ARGV[1] fence (decimal)   ARGV[2] response blob   ARGV[3] ttl (ms)
-- ARGV[4] keep_expired (ms)   ARGV[5] change channel
-- Returns 1 when stored, 0 when the fence is not current (nothing written).
local rec, fkey = KEYS[1], KEYS[2]
local fence, blob = ARGV[1], ARGV[2]
local ttl, keep = tonumber(ARGV[3]), tonumber(ARGV[4])
if current_fence(rec) ~= fence then
  return 0
end
local now = now_ms_us()
local expires_at = now + ttl
local gone_at = expires_at + keep
redis.call('HSET', rec, 'state', 'completed', 'expires_at', int(expires_at), 'response', blob)
redis.call('HDEL', rec, 'lease_until')
redis.call('PEXPIREAT', rec, int(gone_at))
keep_fence(fkey, fence, gone_at, keep)
redis.call('PUBLISH', ARGV[5], 'completed')
return 1
