-- idem: helpers shared by every script. The Rust side prepends this file to
-- each step's script at build time (concat!/include_str!), so every script
-- stays one self-contained EVALSHA.
--
-- Every script touches only keys of ONE record, all carrying the same hash
-- tag {<prefix>:<hex sha-256 of scope and key>}, so on Redis Cluster they
-- live in one slot and the script runs atomically on one primary.
--
-- Time is the server's: TIME inside a script is allowed since Redis 5 with
-- effects replication (the only mode in Redis 7): replicas and the AOF get the
-- script's writes (HSET, PEXPIREAT with absolute milliseconds), never the
-- script, so they never re-run TIME.
--
-- Numbers: Lua 5.1 numbers are doubles, exact for integers below 2^53.
-- Server time in microseconds (~1.7e15) and every fence stay far below
-- that; integers are written with string.format('%.0f') because tostring()
-- would print 1.7e+15.

-- The server's time: (milliseconds, microseconds) since the Unix epoch.
local function now_ms_us()
  local t = redis.call('TIME')
  local s, us = tonumber(t[1]), tonumber(t[2])
  return s * 1000 + math.floor(us / 1000), s * 1000000 + us
end

-- An integer as a decimal string, exact below 2^53.
local function int(n)
  return string.format('%.0f', n)
end

-- The type of a key: 'none', 'hash', 'string', ...
local function key_type(key)
  return redis.call('TYPE', key)['ok']
end

-- The record's current claim: its fence string when the record is a hash in
-- progress, else nil. Used by complete / release / extend ("current fence").
local function current_fence(rec)
  if key_type(rec) ~= 'hash' then
    return nil
  end
  local r = redis.call('HMGET', rec, 'state', 'fence')
  if r[1] ~= 'in_progress' then
    return nil
  end
  return r[2]
end

-- Keeps the fence counter alive past the record's own end: set it to the
-- record's fence and let it expire `keep` ms after the record does.
local function keep_fence(fkey, fence, record_gone_at, keep)
  redis.call('SET', fkey, fence, 'PXAT', int(record_gone_at + keep))
end

