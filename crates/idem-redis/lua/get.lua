-- get: read a record together with the server's time (read only).
-- KEYS[1] the record
-- Returns {now_ms} when absent, {now_ms, type} when the key is not a hash,
-- else {now_ms, 'hash', state, fingerprint, fence, lease_until, expires_at, response,
-- scope, key}
-- (missing fields are nil). The Rust side decides liveness and decodes.
local rec = KEYS[1]
local now = now_ms_us()
local t = key_type(rec)
if t == 'none' then
  return {now}
end
if t ~= 'hash' then
  return {now, t}
end
local r = redis.call('HMGET', rec, 'state', 'fingerprint', 'fence', 'lease_until',
  'expires_at', 'response', 'scope', 'key')
return {now, 'hash', r[1], r[2], r[3], r[4], r[5], r[6], r[7], r[8]}
