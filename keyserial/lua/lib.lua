-- Helpers for keyserial's scripts, put in front of each one when it is loaded (a Redis script
-- cannot import code). Nothing here reads KEYS or ARGV: keys are passed in.

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

-- Write [[key, JSON state or '' to delete], ...] (JSON) to the state hash ``hash``.
local function write_states(hash, writes_json)
  for _, write in ipairs(cjson.decode(writes_json)) do
    if write[2] == '' then
      redis.call('HDEL', hash, write[1])
    else
      redis.call('HSET', hash, write[1], write[2])
    end
  end
end


-- An entry pushed to the owner (the wake-up marker says 'pushed <id>', see submit.lua) may have
-- run already: the horizon (the last entry the owner may have taken) is raised to it, so that
-- whatever reads the horizon next (a step, a release, a takeover) treats it as fetched. Returns
-- the horizon, or nil.
local function fold_pushed(horizon_key, marker_key)
  local horizon = redis.call('GET', horizon_key)
  local marker = redis.call('GET', marker_key)
  if marker and string.sub(marker, 1, 7) == 'pushed ' then
    local pushed = string.sub(marker, 8)
    if not horizon or id_gt(pushed, horizon) then
      horizon = pushed
      redis.call('SET', horizon_key, horizon)
    end
  end
  return horizon
end
