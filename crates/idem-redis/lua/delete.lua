-- delete: remove a record whatever its state (an operator's tool). The fence
-- counter stays, so the next claim still gets a larger fence.
-- KEYS[1] the record   ARGV[1] change channel
-- Returns 1 when a record existed, else 0.
local n = redis.call('DEL', KEYS[1])
if n > 0 then
  redis.call('PUBLISH', ARGV[1], 'deleted')
end
return n
