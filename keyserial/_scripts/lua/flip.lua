-- End a reshard: the namespace's live layout becomes the move's target. Flipping again changes
-- nothing.
-- KEYS[1]  the meta hash
-- ARGV[1]  the move record (JSON) under way      ARGV[2]  its target's generation
-- ARGV[3]  its target's shard count               ARGV[4]  the layouts before (JSON)
-- Returns 1 if flipped now, 0 if it was already; the error "MOVING <record or none>" when the
-- move under way is another (nothing written).
if (redis.call('HGET', KEYS[1], 'generation') or '0') == ARGV[2] then
  return 0
end
local move = redis.call('HGET', KEYS[1], 'move')
if move ~= ARGV[1] then
  return redis.error_reply('MOVING ' .. (move or 'none'))
end
redis.call('HSET', KEYS[1], 'shards', ARGV[3], 'generation', ARGV[2], 'history', ARGV[4])
redis.call('HDEL', KEYS[1], 'move')
return 1
