-- Append one entry of packed op envelopes to a shard's stream, unless its backlog is full,
-- and wake the shard's owner.
-- KEYS[1]  the shard's stream
-- ARGV[1]  backlog limit in entries (0: unbounded)
-- ARGV[2]  wire version ("1")
-- ARGV[3]  the entry's ops: a JSON array of op envelopes
-- ARGV[4]  the shard's wake channel ('' for none: a worker appending to a shard it owns wakes
--          its runner itself)
-- Returns the new entry id; the error "BACKLOG <length>" when the backlog is full (nothing added).
local limit = tonumber(ARGV[1])
if limit > 0 then
  local length = redis.call('XLEN', KEYS[1])
  if length >= limit then
    return redis.error_reply('BACKLOG ' .. length)
  end
end
local id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'ops', ARGV[3])
if ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], id)
end
return id
