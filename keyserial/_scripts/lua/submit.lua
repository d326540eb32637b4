-- Push one entry of packed op envelopes to a shard's inbox, unless its backlog is full, and wake
-- the shard's owner, whose steps move it into the stream (clients write no stream: pushing to a
-- list has no option that drops or reorders another client's entries). A fresh entry travels in
-- its wake-up (a push): the owner takes it in without fetching it, but only where it is the next
-- item of the inbox, its place following on from the last one the owner took, so an entry pushed
-- some other way (a plain RPUSH) is never skipped. Any other entry is announced by its place, and
-- the owner fetches it.
-- KEYS[1]  the shard's inbox, ks:{<ns>:<shard>}:inbox. (The script also reads the inbox's taken
--          count, the items its owner moved out of it so far, :inbox:taken, the stream, :stream,
--          and the seal record a reshard sets, :sealed, named after it: a client user may read
--          them, and Redis requires write access to every key a script is given.)
-- ARGV[1]  backlog limit in entries (0: unbounded)
-- ARGV[2]  wire version ("1")
-- ARGV[3]  the entry's ops: a JSON array of op envelopes
-- ARGV[4]  the shard's wake channel ('' for none: a worker pushing to a shard it owns wakes
--          its runner itself); on a cluster, its shard channel ks:{<ns>:<shard>}:wake:<shard>
--          is published on with SPUBLISH, and stays on the shard's node
-- ARGV[5]  '1' if every op id in the entry is appended for the first time (the item is marked
--          fresh: its owner skips looking up their stored outcomes, and it is pushed); optional
-- ARGV[6]  when its ops are due, by the server's clock: '+<ms>' from now, or '<ms>' since the
--          Unix epoch; '' or none for now. A delayed item (one due later than now) is marked
--          ' at <due ms>' and never pushed (announced by its place): its owner's step moves it
--          into the shard's timers, and fires it into the stream once it is due (see lib.lua).
-- Returns {place, the server's clock (ms), the items ahead of it in the inbox}, and the due
-- time (ms) fourth when ARGV[6] is given (its clock, if due now); the error
-- "BACKLOG <length>" when the backlog is full, or "RESHARDED ..." when a reshard sealed the shard
-- (nothing pushed either way): the ops route by the namespace's layout as its meta hash records
-- it now.
local shard = #KEYS == 1 and string.match(KEYS[1], '^(ks:{[^}]*}):inbox$')
local due_arg = ARGV[6] or ''
local relative, digits = string.match(due_arg, '^(%+?)(%d+)$')
if not shard or #ARGV < 4 or (due_arg ~= '' and (not digits or #digits > 15)) then
  -- (checked first: an error must mean that nothing was pushed)
  return redis.error_reply('ERR submit takes a shard\'s inbox as KEYS[1], and the limit,'
    .. ' version, ops and wake channel (and fresh, and a due time of at most 15 digits) as'
    .. ' ARGV; nothing was pushed')
end
if redis.call('EXISTS', shard .. ':sealed') == 1 then
  return redis.error_reply('RESHARDED the shard moved to a new layout; read it again')
end
local limit = tonumber(ARGV[1])
if limit > 0 then
  local length = redis.call('XLEN', shard .. ':stream') + redis.call('LLEN', KEYS[1])
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
local now = redis.call('TIME')
now = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local due = now
if digits and relative == '+' then
  due = now + tonumber(digits)
elseif digits then
  due = math.max(now, tonumber(digits))
end
local fresh = ARGV[5] == '1'
local head = ARGV[2]
if fresh then
  head = head .. ' fresh'
end
if due > now then
  head = head .. ' at ' .. string.format('%d', due)
end
local item = head .. '\n' .. ARGV[3]
local ahead = redis.call('RPUSH', KEYS[1], item) - 1
local place = tonumber(redis.call('GET', shard .. ':inbox:taken') or '0') + ahead + 1
if fresh and due == now and ARGV[4] ~= '' then
  wake('push ' .. string.format('%d', place) .. ' ' .. item)
elseif ARGV[4] ~= '' then
  wake(string.format('%d', place))
end
if due_arg ~= '' then
  return {place, now, ahead, due}
end
return {place, now, ahead}
