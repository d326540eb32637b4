-- Give a shard's lease up cleanly (shutdown), so a standby takes over at once. Entries fetched
-- but not committed are not the ops' fault: the horizon drops back to progress, so the next
-- owner neither suspects them nor runs in careful mode.
-- KEYS[1]  lease      KEYS[2]  progress      KEYS[3]  horizon
-- ARGV[1]  the owner's token
-- Returns 1 if released, 0 if the lease was not the caller's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
local progress = redis.call('GET', KEYS[2])
if progress then
  redis.call('SET', KEYS[3], progress)
else
  redis.call('DEL', KEYS[3])
end
return 1
