-- begin: claim a key, or say why not. One atomic step.
-- KEYS[1] the record (hash)   KEYS[2] the fence counter (string)
-- ARGV[1] fingerprint (32 raw bytes)   ARGV[2] lease (ms)   ARGV[3] keep_expired (ms)
-- ARGV[4] scope   ARGV[5] key (kept in the record for listing)
-- Returns one of
--   {'acquired', fence, lease_until_ms, took_over}  (took_over: 1 when an
--     ended claim was taken over, 0 for an absent key or an ended result)
--   {'in_flight', ms_left}
--   {'replay', response_blob}
--   {'mismatch'}
--   {'corrupt', detail}
local rec, fkey = KEYS[1], KEYS[2]
local fp, lease, keep = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now, now_us = now_ms_us()

local took_over = 0
local t = key_type(rec)
if t == 'hash' then
  local r = redis.call('HMGET', rec, 'state', 'fingerprint', 'lease_until', 'expires_at')
  local state, rfp = r[1], r[2]
  if type(rfp) ~= 'string' or #rfp ~= 32 then
    return {'corrupt', 'fingerprint is missing or not 32 bytes'}
  end
  if state == 'in_progress' then
    local lu = tonumber(r[3])
    if not lu then
      return {'corrupt', 'lease_until is missing or not a number'}
    end
    if lu > now then
      if rfp == fp then
        return {'in_flight', lu - now}
      end
      return {'mismatch'}
    end
    -- An ended claim is taken over only by the same request.
    if rfp ~= fp then
      return {'mismatch'}
    end
    took_over = 1
  elseif state == 'completed' then
    local ex = tonumber(r[4])
    if not ex then
      return {'corrupt', 'expires_at is missing or not a number'}
    end
    if ex > now then
      if rfp ~= fp then
        return {'mismatch'}
      end
      local resp = redis.call('HGET', rec, 'response')
      if not resp then
        return {'corrupt', 'completed record without a response'}
      end
      return {'replay', resp}
    end
  else
    return {'corrupt', 'unknown state'}
  end
elseif t ~= 'none' then
  return {'corrupt', 'record key holds a ' .. t .. ', not a hash'}
end

-- Absent, or past its lease / TTL: claim it with a larger fence.
-- fence = max(previous + 1, server time in microseconds): the counter key
-- outlives every record of the key by keep_expired, and when it is gone the
-- clock (which has moved on by at least keep_expired since) still exceeds
-- every fence granted before.
local prev = 0
local ft = key_type(fkey)
if ft == 'string' then
  prev = tonumber(redis.call('GET', fkey))
  if not prev then
    return {'corrupt', 'fence counter is not a number'}
  end
elseif ft ~= 'none' then
  return {'corrupt', 'fence counter key holds a ' .. ft .. ', not a string'}
end
local fence = math.max(prev + 1, now_us)
local lease_until = now + lease
local gone_at = lease_until + keep
redis.call('DEL', rec)
redis.call('HSET', rec, 'state', 'in_progress', 'fingerprint', fp,
  'fence', int(fence), 'lease_until', int(lease_until), 'scope', ARGV[4], 'key', ARGV[5])
redis.call('PEXPIREAT', rec, int(gone_at))
keep_fence(fkey, int(fence), gone_at, keep)
return {'acquired', fence, lease_until, took_over}
