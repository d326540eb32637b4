-- Append one entry of packed op envelopes to a shard's stream, unless its backlog is full, and
-- wake the shard's owner. A fresh entry travels in its wake-up (a push): the owner takes it in
-- without fetching it. The push names the entry that stood last in the stream before it ('-'
-- when the stream was empty), and the owner takes it in only if its cursor stands there, so an
-- entry appended some other way (a plain XADD, an older client) is never skipped. Any other
-- entry is announced by its id, and the owner fetches it.
-- KEYS[1]  the shard's stream (a second key, which older versions took, is ignored)
-- ARGV[1]  backlog limit in entries (0: unbounded)
-- ARGV[2]  wire version ("1")
-- ARGV[3]  the entry's ops: a JSON array of op envelopes
-- ARGV[4]  the shard's wake channel ('' for none: a worker appending to a shard it owns wakes
--          its runner itself); on a cluster, its shard channel ks:{<ns>:<shard>}:wake:<shard>
--          is published on with SPUBLISH, and stays on the shard's node
-- ARGV[5]  '1' if every op id in the entry is appended for the first time (the entry's field
--          fresh = '1': its owner skips looking up their stored outcomes, and it is pushed);
--          optional
-- ARGV[6]  '1' to append to a shard a reshard sealed (a grant request of an op appended before
--          the seal: see _wire/resharding.py); optional
-- Returns the new entry id; the error "BACKLOG <length>" when the backlog is full, or
-- "RESHARDED ..." when a reshard sealed the shard (nothing added either way): the ops route by
-- the namespace's layout as its meta hash records it now.
if #KEYS < 1 or #ARGV < 4 then  -- (checked first: an error must mean that nothing was appended)
  return redis.error_reply('ERR submit takes the stream as KEYS[1], and the limit, version,'
    .. ' ops and wake channel (and fresh) as ARGV; nothing was appended')
end
if ARGV[6] ~= '1' and string.sub(KEYS[1], -7) == ':stream'
    and redis.call('EXISTS', string.sub(KEYS[1], 1, -8) .. ':sealed') == 1 then
  return redis.error_reply('RESHARDED the shard moved to a new layout; read it again')
end
local limit = tonumber(ARGV[1])
if limit > 0 then
  local length = redis.call('XLEN', KEYS[1])
  if length >= limit then
    return redis.error_reply('BACKLOG ' .. length)
  end
end
-- (This script is sent alone by foreign clients: it needs none of lib.lua's helpers.)
local function wake(message)
  local tag = string.match(KEYS[1], '^ks:{[^}]*}')
  if tag and string.sub(ARGV[4], 1, #tag) == tag then
    local sent = redis.pcall('SPUBLISH', ARGV[4], message)
    if type(sent) == 'number' then
      return
    end
  end
  redis.call('PUBLISH', ARGV[4], message)
end
local fresh = ARGV[5] == '1'
local push = fresh and ARGV[4] ~= ''
local before = nil
if push then
  local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
  before = last and last[1] or '-'
end
local id
if fresh then
  id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'ops', ARGV[3], 'fresh', '1')
else
  id = redis.call('XADD', KEYS[1], '*', 'v', ARGV[2], 'ops', ARGV[3])
end
if push then
  wake('push ' .. before .. ' ' .. id .. ' ' .. ARGV[2] .. '\n' .. ARGV[3])
elseif ARGV[4] ~= '' then
  wake(id)
end
return id
