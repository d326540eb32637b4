-- Keep a coordinating attempt alive (fenced): participants holding keys for it abort it once its
-- deadline passes, so only a live owner of the home shard may push it back.
-- KEYS[1]  epoch      KEYS[2]  results
-- ARGV[1]  the owner's epoch   ARGV[2]  op id   ARGV[3]  alive TTL (ms)
-- Returns 1; error "FENCED ..." if another owner took over.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
redis.call('HSET', KEYS[2], ARGV[2] .. '#alive', now_ms + tonumber(ARGV[3]))
return 1
