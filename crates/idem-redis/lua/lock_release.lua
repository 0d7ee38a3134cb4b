-- idem lock: compare-and-delete on the owner token.
-- KEYS[1] the lock   ARGV[1] owner token
-- Returns 1 when this owner held the lock (now deleted), else 0 (a no-op:
-- the lease had passed and the lock is free or another owner's).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
