-- purge: remove the record if it has ended (in progress past its lease,
-- completed past its TTL). Records that do not decode are left alone for an
-- operator (get reports them as corrupt).
-- KEYS[1] the record   ARGV[1] change channel
-- Returns 1 when removed, else 0.
local rec = KEYS[1]
if key_type(rec) ~= 'hash' then
  return 0
end
local r = redis.call('HMGET', rec, 'state', 'lease_until', 'expires_at')
local deadline
if r[1] == 'in_progress' then
  deadline = tonumber(r[2])
elseif r[1] == 'completed' then
  deadline = tonumber(r[3])
end
if not deadline then
  return 0
end
local now = now_ms_us()
if deadline > now then
  return 0
end
redis.call('DEL', rec)
redis.call('PUBLISH', ARGV[1], 'purged')
return 1
