-- Start a new attempt at coordinating a cross-shard op, on its home shard (fenced).
-- Attempts are numbered by the home shard, so a zombie coordinator and its successor never share
-- one. Every earlier attempt that has no decision yet is aborted (set-if-absent), so participants
-- still holding keys for a dead coordinator release them at their next look.
-- Fields live in the results hash (cleaned up with it): '<op>#attempts' counter, '<op>#alive'
-- deadline (ms, server time) of the current attempt, '<op>#<n>#d' decision of attempt n.
-- KEYS[1]  epoch      KEYS[2]  results    KEYS[3]  results expiry
-- ARGV[1]  the owner's epoch   ARGV[2]  op id   ARGV[3]  alive TTL (ms)   ARGV[4]  retention (ms)
-- Returns the new attempt number; error "FENCED ..." if another owner took over.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local expires_at = now_ms + tonumber(ARGV[4])
local op = ARGV[2]
local attempt = redis.call('HINCRBY', KEYS[2], op .. '#attempts', 1)
for earlier = 1, attempt - 1 do
  local field = op .. '#' .. earlier .. '#d'
  if redis.call('HSETNX', KEYS[2], field, '{"abort":"superseded"}') == 1 then
    redis.call('ZADD', KEYS[3], expires_at, field)
  end
end
redis.call('HSET', KEYS[2], op .. '#alive', now_ms + tonumber(ARGV[3]))
redis.call('ZADD', KEYS[3], expires_at, op .. '#attempts', expires_at, op .. '#alive')
return attempt
