-- Append one entry of packed op envelopes to a shard's stream, unless its backlog is full,
-- and wake the shard's owner, as its wake-up marker says:
--   'busy'          it fetches again anyway: no message;
--   'idle <id>'     its last fetch found nothing after entry <id>. If the new entry is the only
--                   one after <id> and fresh, the message carries the entry (a push: the owner
--                   runs it without fetching it) and the marker becomes 'pushed <new id>', which
--                   a takeover treats as fetched; otherwise the message is the new entry id;
--   anything else   (none: a worker of an older version, or the owner is gone) the entry id.
-- KEYS[1]  the shard's stream
-- KEYS[2]  the shard's wake-up marker (optional: without it, always the entry id)
-- ARGV[1]  backlog limit in entries (0: unbounded)
-- ARGV[2]  wire version ("1")
-- ARGV[3]  the entry's ops: a JSON array of op envelopes
-- ARGV[4]  the shard's wake channel ('' for none: a worker appending to a shard it owns wakes
--          its runner itself)
-- ARGV[5]  '1' if every op id in the entry is appended for the first time (the entry's field
--          fresh = '1': its owner skips looking up their stored outcomes); optional
-- Returns the new entry id; the error "BACKLOG <length>" when the backlog is full (nothing added).
if #KEYS < 1 or #ARGV < 4 then  -- (checked first: an error must mean that nothing was appended)
  return redis.error_reply('ERR submit takes the stream (and the marker) as KEYS, and the limit,'
    .. ' version, ops and wake channel (and fresh) as ARGV; nothing was appended')
end
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
if ARGV[4] == '' then
  return id
end
local marker = KEYS[2] and redis.call('GET', KEYS[2])
if marker == 'busy' then
  return id
end
if marker and ARGV[5] == '1' and string.sub(marker, 1, 5) == 'idle ' then
  local after = string.sub(marker, 6)
  if #redis.call('XRANGE', KEYS[1], '(' .. after, '+', 'COUNT', 2) == 1 then
    redis.call('SET', KEYS[2], 'pushed ' .. id)
    redis.call('PUBLISH', ARGV[4], 'push ' .. after .. ' ' .. id .. ' ' .. ARGV[2] .. '\n' .. ARGV[3])
    return id
  end
end
redis.call('PUBLISH', ARGV[4], id)
return id
