-- Helpers for keyserial's scripts, put in front of each one when it is loaded (a Redis script
-- cannot import code). Nothing here touches a key or reads KEYS or ARGV.

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

