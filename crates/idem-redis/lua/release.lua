-- release: free the key, only while the caller's fence is current.
-- KEYS[1] the record   KEYS[2] the fence counter (kept: fences grow across release)
-- ARGV[1] fence (decimal)   ARGV[2] change channel
-- Returns 1 when released, 0 when the fence is not current.
local rec = KEYS[1]
if current_fence(rec) ~= ARGV[1] then
  return 0
end
redis.call('DEL', rec)
redis.call('PUBLISH', ARGV[2], 'released')
return 1
