-- Extend a shard's lease if the caller still holds it.
-- KEYS[1]  lease
-- ARGV[1]  the owner's token      ARGV[2]  TTL in milliseconds
-- Returns 1 if renewed, 0 if the lease is gone or someone else's.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
