-- Append one entry of packed op envelopes to a shard's stream, unless its backlog is full,
-- and wake the shard's owner.
-- KEYS[1]  the shard's stream
-- ARGV[1]  backlog limit in entries (0: unbounded)
-- ARGV[2]  wire version ("1")
-- ARGV[3]  the entry's ops: a JSON array of op envelopes
-- ARGV[4]  the shard's wake channel ('' for none: a worker appending to a shard it owns wakes
--          its runner itself)
-- ARGV[5]  '1' if every op id in the entry is appended for the first time (the entry's field
--          fresh = '1': its owner skips looking up their stored outcomes); optional
-- Returns the new entry id; the error "BACKLOG <length>" when the backlog is full (nothing added).
local limit = tonumber(ARGV[1])
if limit > 0 then
  local length = redis.call('XLEN', KEYS[1])
  if length >= limit then
    return redis.error_reply('BACKLOG ' .. length)
  end
end
local id
if ARGV[5] == '1' then
  id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'ops', ARGV[3], 'fresh', '1')
else
  id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'ops', ARGV[3])
end
if ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], id)
end
return id
