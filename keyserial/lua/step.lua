-- One step of a shard's owner: commit the ops finished since the last step, then fetch the next
-- entries. Under load a shard costs one round trip per batch.
--
-- The commit is atomic and fenced: the state writes, results and progress of the finished ops,
-- then their replies (the output gate: nothing is replied before it is committed).
-- The fetch returns entries after the owner's cursor, the stored outcome of any op id that
-- already has one (a resubmitted op: reply with it, never run it again), and the committed
-- state of every key the entries name (the owner ignores keys it already caches).
--
-- KEYS[1]  epoch      KEYS[2]  state      KEYS[3]  progress    KEYS[4]  stream
-- KEYS[5]  results    KEYS[6]  results expiry (sorted set)     KEYS[7]  dead-letter stream
-- KEYS[8]  horizon
-- ARGV[1]  the owner's epoch
-- ARGV[2]  new progress: id of the last entry whose ops have all finished, or '' to keep it
-- ARGV[3]  result retention in milliseconds
-- ARGV[4]  cursor: the last entry id already fetched (exclusive)
-- ARGV[5]  how many entries to fetch (0: commit only)
-- ARGV[6]  what to commit, one JSON object (one argument: cheaper to send than many), or '':
--   {"s": [[key, JSON state or '' to delete], ...], "r": [[op id, JSON outcome], ...],
--    "d": [[entry id, reason, raw entry], ...], "p": [[channel, message], ...]}
-- ARGV[7]  '1' in careful mode (after an unclean takeover: entries at or below the horizon are
--          fetched again, so the horizon is only raised); '0' otherwise (every fetched entry is
--          past the horizon, so it is set without reading it)
-- ARGV[8]  how many expired results to drop at most (0: none this step; the owner asks every so
--          often rather than on every step)
-- Returns {entries, done, states}: entries as XRANGE returns them; done = {op id, outcome, ...};
-- states = {key, JSON state or '', ...}. Error "FENCED ..." (nothing written) if another owner
-- took over: the epoch moved on.
-- Stream-id helpers: also in the other fenced scripts (a Redis script cannot import code).
local function parse_id(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_gt(a, b)
  local am, as = parse_id(a)
  local bm, bs = parse_id(b)
  return am > bm or (am == bm and as > bs)
end

-- One command for many arguments (a few per step, not one per op), in bounded chunks: unpack()
-- has a stack limit. (The chunk is even, so field-value pairs never split.)
local CHUNK = 1000
local function each_chunk(args, call)
  for first = 1, #args, CHUNK do
    call(unpack(args, first, math.min(first + CHUNK - 1, #args)))
  end
end
local function multi(command, key, args)
  each_chunk(args, function(...) redis.call(command, key, ...) end)
end
local function hmget(key, fields)
  local values = {}
  each_chunk(fields, function(...)
    for _, value in ipairs(redis.call('HMGET', key, ...)) do
      values[#values + 1] = value
    end
  end)
  return values
end

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end

-- Commit.
local commit = {s = {}, r = {}, d = {}, p = {}}
if ARGV[6] ~= '' then
  commit = cjson.decode(ARGV[6])
end
local sets, deletes = {}, {}
for _, write in ipairs(commit.s) do
  if write[2] == '' then
    deletes[#deletes + 1] = write[1]
  else
    sets[#sets + 1] = write[1]
    sets[#sets + 1] = write[2]
  end
end
multi('HSET', KEYS[2], sets)
multi('HDEL', KEYS[2], deletes)
local now_ms = 0
if #commit.r > 0 or tonumber(ARGV[8]) > 0 then
  local time = redis.call('TIME')
  now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
local stored, expiry = {}, {}
local expires_at = now_ms + tonumber(ARGV[3])
for _, result in ipairs(commit.r) do
  stored[#stored + 1] = result[1]
  stored[#stored + 1] = result[2]
  expiry[#expiry + 1] = expires_at
  expiry[#expiry + 1] = result[1]
end
multi('HSET', KEYS[5], stored)
multi('ZADD', KEYS[6], expiry)
for _, letter in ipairs(commit.d) do
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', 10000, '*',
    'entry', letter[1], 'reason', letter[2], 'raw', letter[3])
end
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[3], ARGV[2])
  -- Exact trim of every committed entry, so XLEN is the backlog the submit script checks.
  local ms, seq = parse_id(ARGV[2])
  redis.call('XTRIM', KEYS[4], 'MINID', string.format('%d-%d', ms, seq + 1))
end
if tonumber(ARGV[8]) > 0 then
  -- Drop expired results, a bounded number per call so no call ever stalls the server.
  local expired = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now_ms, 'LIMIT', 0, ARGV[8])
  if #expired > 0 then
    redis.call('HDEL', KEYS[5], unpack(expired))
    redis.call('ZREM', KEYS[6], unpack(expired))
  end
end
for _, reply in ipairs(commit.p) do
  redis.call('PUBLISH', reply[1], reply[2])
end

-- Fetch.
local entries, done, states = {}, {}, {}
if tonumber(ARGV[5]) == 0 then
  return {entries, done, states}
end
entries = redis.call('XRANGE', KEYS[4], '(' .. ARGV[4], '+', 'COUNT', ARGV[5])
if #entries == 0 then
  return {entries, done, states}
end
local last = entries[#entries][1]
if ARGV[7] == '0' then
  redis.call('SET', KEYS[8], last)
else
  local horizon = redis.call('GET', KEYS[8])
  if not horizon or id_gt(last, horizon) then
    redis.call('SET', KEYS[8], last)
  end
end
local ids, keys, seen = {}, {}, {}
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for f = 1, #fields, 2 do
    if fields[f] == 'ops' then
      local ok, ops = pcall(cjson.decode, fields[f + 1])
      if ok and type(ops) == 'table' then
        for _, envelope in ipairs(ops) do
          if type(envelope) == 'table' and type(envelope.id) == 'string' then
            ids[#ids + 1] = envelope.id
            local named = envelope.keys
            if type(named) ~= 'table' then
              named = {envelope.key}
            end
            for _, key in ipairs(named) do
              if type(key) == 'string' and not seen[key] then
                seen[key] = true
                keys[#keys + 1] = key
              end
            end
          end
        end
      end
    end
  end
end
for i, outcome in ipairs(hmget(KEYS[5], ids)) do
  if outcome then
    done[#done + 1] = ids[i]
    done[#done + 1] = outcome
  end
end
for i, state in ipairs(hmget(KEYS[2], keys)) do
  states[#states + 1] = keys[i]
  states[#states + 1] = state or ''
end
return {entries, done, states}
