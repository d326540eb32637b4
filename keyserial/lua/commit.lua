-- Group commit: the state writes, results and progress of finished ops, in one atomic step,
-- fenced by the owner's epoch; then their replies (the output gate: no reply before commit).
-- KEYS[1]  epoch      KEYS[2]  state      KEYS[3]  progress    KEYS[4]  stream
-- KEYS[5]  results    KEYS[6]  results expiry (sorted set)     KEYS[7]  dead-letter stream
-- ARGV[1]  the owner's epoch
-- ARGV[2]  new progress: id of the last entry whose ops have all finished, or '' to keep it
-- ARGV[3]  result retention in milliseconds
-- then four groups, each a count followed by its items:
--   state writes   (key, JSON state or '' to delete) pairs
--   results        (op id, JSON outcome) pairs
--   dead letters   (entry id, reason, raw entry) triples
--   replies        (channel, message) pairs
-- Returns the number of results written. Error "FENCED ..." (nothing written) if another
-- owner took over.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires_at = now_ms + tonumber(ARGV[3])

local i = 4
local count = tonumber(ARGV[i])
for j = i + 1, i + 2 * count, 2 do
  if ARGV[j + 1] == '' then
    redis.call('HDEL', KEYS[2], ARGV[j])
  else
    redis.call('HSET', KEYS[2], ARGV[j], ARGV[j + 1])
  end
end
i = i + 2 * count + 1

local results = tonumber(ARGV[i])
for j = i + 1, i + 2 * results, 2 do
  redis.call('HSET', KEYS[5], ARGV[j], ARGV[j + 1])
  redis.call('ZADD', KEYS[6], expires_at, ARGV[j])
end
i = i + 2 * results + 1

count = tonumber(ARGV[i])
for j = i + 1, i + 3 * count, 3 do
  redis.call('XADD', KEYS[7], 'MAXLEN', '~', 10000, '*',
    'entry', ARGV[j], 'reason', ARGV[j + 1], 'raw', ARGV[j + 2])
end
i = i + 3 * count + 1

if ARGV[2] ~= '' then
  redis.call('SET', KEYS[3], ARGV[2])
  redis.call('XTRIM', KEYS[4], 'MINID', '~', ARGV[2])
end

-- Drop expired results, a bounded number per commit so no call ever stalls the server.
local expired = redis.call('ZRANGEBYSCORE', KEYS[6], '-inf', now_ms, 'LIMIT', 0, 2 * results + 16)
if #expired > 0 then
  redis.call('HDEL', KEYS[5], unpack(expired))
  redis.call('ZREM', KEYS[6], unpack(expired))
end

count = tonumber(ARGV[i])
for j = i + 1, i + 2 * count, 2 do
  redis.call('PUBLISH', ARGV[j], ARGV[j + 1])
end
return results
