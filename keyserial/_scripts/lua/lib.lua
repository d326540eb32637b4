-- Helpers for keyserial's scripts, put in front of each one that uses one of them when it is
-- loaded (a Redis script cannot import code). Nothing here reads KEYS or ARGV: keys are passed
-- in.

-- Stream ids: '<ms>-<seq>', compared as numbers.
local function parse_id(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_gt(a, b)
  local am, as = parse_id(a)
  local bm, bs = parse_id(b)
  return am > bm or (am == bm and as > bs)
end

-- The largest stream id there is (XADD takes it by hand): nothing can follow it, and a range
-- that starts after it is an error, not an empty range.
local LARGEST_ID = '18446744073709551615-18446744073709551615'
-- XRANGE ``key`` from after ``after`` to ``upto`` (at most ``count`` entries): none after the
-- largest id.
local function xrange_after(key, after, upto, count)
  if after == LARGEST_ID then
    return {}
  end
  return redis.call('XRANGE', key, '(' .. after, upto, 'COUNT', count)
end

-- An op's outcome is written once. A commit that finds an outcome it would store already stored
-- is either itself, sent again after its reply was lost (it landed: every write it carries
-- holds already), or a replay: an op run again under an id that already has an outcome (an
-- entry re-appended with ``fresh``, a replayed push). A replay writes nothing: its owner ran it
-- on a cache that Redis does not hold, and gives its shard up (the next owner answers the op
-- from its stored outcome).
local function replayed_error(what)
  return redis.error_reply('REPLAYED ' .. what .. ' has an outcome already; nothing was written')
end
-- Whether the op id has a stored outcome, in either results generation.
local function has_outcome(results, previous, op_id)
  return redis.call('HEXISTS', results, op_id) == 1 or redis.call('HEXISTS', previous, op_id) == 1
end

-- A shard's inbox (see submit.lua): clients push entries there, and only its owner's scripts move
-- them into the stream. An item is '<version>\n<ops>', or '<version> fresh\n<ops>'; its place is
-- its number in the order of pushes, from 1: the inbox's taken count (the items moved out of it
-- so far) plus its index in the inbox, from 1. A delayed item's first line ends in ' at <ms>',
-- its due time by the server's clock: moved out of the inbox, it waits in the shard's timers
-- (see below) as the item without it, until a step fires it into the stream.
-- The stream entry of the item at ``place``: its fields and values, as XADD takes them. An item
-- not of that form becomes an entry of its raw text, which the owner dead-letters.
local function inbox_entry(item, place)
  local newline = string.find(item, '\n', 1, true)
  local version, flags = string.match(string.sub(item, 1, (newline or 1) - 1), '^([^ ]+)(.*)$')
  if version and flags == '' then
    return {'v', version, 'ops', string.sub(item, newline + 1), 'p', place}
  elseif version and flags == ' fresh' then
    return {'v', version, 'ops', string.sub(item, newline + 1), 'fresh', '1', 'p', place}
  end
  return {'raw', item, 'p', place}
end
-- A delayed item's due time (ms) and the item it waits as; nil for any other item. (At most 15
-- digits: a larger one would lose its last ones to Lua's numbers.)
local function item_due(item)
  local newline = string.find(item, '\n', 1, true)
  local head, due = string.match(string.sub(item, 1, (newline or 1) - 1), '^(.-) at (%d+)$')
  if not head or #due > 15 then
    return nil
  end
  return tonumber(due), head .. string.sub(item, newline)
end
-- The server's clock, in ms.
local function now_ms()
  local now = redis.call('TIME')
  return tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
end
-- A shard's timers: a sorted set (member: the timer's id; score: its due time in ms by the
-- server's clock) and a hash (the timer's id -> the inbox item it fires as), named after its
-- stream. Only its owner's scripts write them. A delayed item's timer id is its place, 16 digits
-- wide: timers due in the same millisecond fire in the order they were pushed.
local function timer_keys(stream)
  local shard = string.match(stream, '^(ks:{[^}]*}):stream$')
  return shard .. ':timers', shard .. ':timed'
end
local function timer_id(place)
  return string.format('%016d', place)
end
-- Append an entry of ``fields`` to ``stream`` under an id of Redis's own. Returns its id, or nil
-- if the stream has no id left (an entry under the largest id). Any other refusal ends the script
-- with it: out of memory (OOM) comes only at a script's first write, so nothing is written then.
local function append_moved(stream, fields)
  local id = redis.pcall('XADD', stream, '*', unpack(fields))
  if type(id) == 'string' then
    return id
  elseif string.find(id.err, 'exhausted the last possible ID', 1, true) then
    return nil
  end
  error(id)
end
-- Put the delayed item at ``place`` in the timers, due or not: the fetching step that fires
-- timers fires every due one in the order of their due times (a delayed item that came due
-- while the shard had no owner takes its place among the timers due meanwhile).
local function schedule_item(stream, item, place)
  local due, waiting = item_due(item)
  local timers, timed = timer_keys(stream)
  redis.call('ZADD', timers, due, timer_id(place))
  redis.call('HSET', timed, timer_id(place), waiting)
  return ''
end
-- Move ``items``, the first items of ``inbox`` (read by the caller), into ``stream``, in order,
-- and count them in ``taken`` (whose count the caller may know: ``first``); a delayed item goes
-- to the timers instead (its id ''). Returns the ids of their entries, and the
-- count after (nil if nothing was read): fewer ids than items (none) if the stream has no id
-- left (an entry under the largest id, see step.lua's RESTARTED), when the items stay in the
-- inbox and nothing is written.
local function move_items(inbox, taken, stream, items, first)
  local ids = {}
  if #items == 0 then
    return ids, first
  end
  first = first or tonumber(redis.call('GET', taken) or '0')
  for i, item in ipairs(items) do
    local place = string.format('%d', first + i)
    local id
    if item_due(item) then
      id = schedule_item(stream, item, first + i)
    else
      id = append_moved(stream, inbox_entry(item, place))
    end
    if not id then
      break
    end
    ids[i] = id
  end
  if #ids > 0 then
    redis.call('LTRIM', inbox, #ids, -1)
    redis.call('SET', taken, string.format('%d', first + #ids))
  end
  return ids, first + #ids
end
-- Fire the timers of ``stream``'s shard that are due by the server's clock: append up to
-- ``count`` of them to the stream, in the order of their due times (then ids), and remove them.
-- Each fires once (its removal and its append are one script's writes) and never early (the
-- script compares the clock it reads). Its entry is its item's, with 'p' its place (or its id)
-- and 'due' its due time, and 'timer' = '1' for a timer an op set (its id holds '#', which no
-- client's item has: its op may run under that id). Returns how many fired, and the ms until
-- the next timer is due (0 if one is due already; nil if none is waiting).
local function fire_timers(stream, count)
  local timers, timed = timer_keys(stream)
  local now = now_ms()
  local due = redis.call('ZRANGE', timers, '-inf', now, 'BYSCORE', 'LIMIT', 0, count,
    'WITHSCORES')
  local fired = {}
  for i = 1, #due, 2 do
    local id = due[i]
    local item = redis.call('HGET', timed, id)
    if item then
      local place = tonumber(id)  -- (a timer a reshard moved keeps its id: not a place here)
      local fields = inbox_entry(item, place and string.format('%d', place) or id)
      if string.find(id, '#', 1, true) then  -- (set by an op: its op id is the timer's)
        fields[#fields + 1] = 'timer'
        fields[#fields + 1] = '1'
      end
      fields[#fields + 1] = 'due'
      fields[#fields + 1] = due[i + 1]
      if not append_moved(stream, fields) then
        break
      end
    end
    fired[#fired + 1] = id
  end
  if #fired > 0 then
    redis.call('ZREM', timers, unpack(fired))
    redis.call('HDEL', timed, unpack(fired))
  end
  local next_due = redis.call('ZRANGE', timers, 0, 0, 'WITHSCORES')[2]
  if not next_due then
    return #fired, nil, 0
  end
  return #fired, math.max(0, tonumber(next_due) - now), redis.call('ZCARD', timers)
end
-- Take ``items``, the first items of ``inbox`` (taken in from pushes), out of it: those whose
-- ``keep`` flag ('1' or '0', one per item) is '1' move into ``stream`` as ``move_items`` moves
-- them, the others go (their ops have all committed). ``first``: the taken count before them.
-- Returns their entries' ids ('' for an item not kept) and the count after; nil (nothing
-- written) if the stream has no id left for the first kept one.
local function take_items(inbox, taken, stream, items, keep, first)
  local ids = {}
  for i, item in ipairs(items) do
    ids[i] = ''
    if string.sub(keep, i, i) == '1' then
      local fields = inbox_entry(item, string.format('%d', first + i))
      local id = append_moved(stream, fields)
      if not id then
        return nil
      end
      ids[i] = id
    end
  end
  redis.call('LTRIM', inbox, #items, -1)
  redis.call('SET', taken, string.format('%d', first + #items))
  return ids, first + #items
end
-- Move the whole inbox into the stream (a seal, a takeover of an owner that took pushes).
local function move_inbox(inbox, taken, stream)
  return move_items(inbox, taken, stream, redis.call('LRANGE', inbox, 0, -1))
end

-- Entries pushed to an owner with their wake-ups (see submit.lua) may have run before any write
-- of the owner's recorded them: every item of the inbox is moved into the stream, and the horizon
-- (the last entry the owner may have taken) raised to the last entry there, so that whatever
-- reads it next (a release, a takeover) treats every entry the owner could have been pushed as
-- fetched. Not on a sealed shard: its seal moved the inbox in, and no item pushed since was
-- taken (a step refuses pushes there); they are strays, forwarded from the inbox, where a
-- client user cannot read their op ids. Returns the horizon, or nil.
local function fold_pushes(horizon_key, stream_key, inbox_key, taken_key, sealed_key)
  if redis.call('EXISTS', sealed_key) == 0 then
    move_inbox(inbox_key, taken_key, stream_key)
  end
  local horizon = redis.call('GET', horizon_key)
  local last = redis.call('XREVRANGE', stream_key, '+', '-', 'COUNT', 1)[1]
  if last and (not horizon or id_gt(last[1], horizon)) then
    horizon = last[1]
    redis.call('SET', horizon_key, horizon)
  end
  return horizon
end

-- Publish ``message`` on ``channel``: a shard channel of this script's slot (its name begins
-- with the hash tag of ``key``, one of the script's keys) with SPUBLISH, so it stays on this
-- node; any other channel with PUBLISH. (A server without SPUBLISH refuses it: PUBLISH then.)
local function publish(key, channel, message)
  local tag = string.match(key, '^ks:{[^}]*}')
  if tag and string.sub(channel, 1, #tag) == tag then
    local sent = redis.pcall('SPUBLISH', channel, message)
    if type(sent) == 'number' then
      return sent
    end
  end
  return redis.call('PUBLISH', channel, message)
end

-- The last id a stream ever generated ('0-0' for a stream that never existed): entries appended
-- and since trimmed still count (a reshard's seal and drain checks compare against it).
local function last_generated_id(stream)
  local info = redis.pcall('XINFO', 'STREAM', stream)
  if type(info) == 'table' and not info.err then
    for i = 1, #info, 2 do
      if info[i] == 'last-generated-id' then
        return info[i + 1]
      end
    end
  end
  return '0-0'
end
