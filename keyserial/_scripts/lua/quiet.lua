-- Read whether a sealed shard is quiet, in one snapshot. Writes nothing.
-- KEYS[1]  stream      KEYS[2]  seal record      KEYS[3]  drained record      KEYS[4]  held hash
-- Returns {seal record or '', drained record or '', the stream's last generated id or '0-0',
-- how many holds the shard keeps for other shards' cross-shard ops}.
local last = last_generated_id(KEYS[1])
return {redis.call('GET', KEYS[2]) or '', redis.call('GET', KEYS[3]) or '', last,
  redis.call('HLEN', KEYS[4])}
