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

-- Entries pushed to an owner with their wake-ups (see submit.lua) may have run before any write
-- of the owner's recorded them: the horizon (the last entry the owner may have taken) is raised
-- to the last entry in the stream, so that whatever reads it next (a release, a takeover) treats
-- every entry the owner could have been pushed as fetched. Returns the horizon, or nil.
local function fold_pushes(horizon_key, stream_key)
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
