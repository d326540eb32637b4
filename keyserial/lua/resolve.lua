-- A participant holding keys for a cross-shard op asks the home shard what became of the
-- attempt. If the attempt has no decision and its coordinator stopped keeping it alive (died,
-- froze, lost its lease), the participant aborts it (set-if-absent: a late commit then loses).
-- Not fenced: aborting is always safe, and this only writes an abort.
-- KEYS[1]  the home shard's results hash    KEYS[2]  its results expiry
-- ARGV[1]  op id   ARGV[2]  attempt   ARGV[3]  retention (ms)
-- Returns the decision (JSON), or nil while the attempt is undecided and alive.
local field = ARGV[1] .. '#' .. ARGV[2] .. '#d'
local decision = redis.call('HGET', KEYS[1], field)
if decision then
  return decision
end
local time = redis.call('TIME')
local now_ms = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local current = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. '#attempts') or '0')
local alive = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. '#alive') or '0')
if current == tonumber(ARGV[2]) and alive > now_ms then
  return nil
end
decision = '{"abort":"coordinator stopped"}'
redis.call('HSET', KEYS[1], field, decision)
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), field)
return decision
