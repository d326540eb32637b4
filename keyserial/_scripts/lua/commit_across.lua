-- Commit a cross-shard op whose shards one worker owns, on a standalone server: one script,
-- fenced by every shard's epoch, writes every shard's keys, the op's result and its replies.
-- Being atomic across the shards, it needs no grant or decision records. (On a cluster the
-- shards' keys sit in different slots, which one script cannot touch: the grant protocol runs.)
-- Idempotent: sent again after a lost reply, it finds the op's result, and writes nothing more.
-- It answers that it landed only if every write it carries holds on each shard still owned by
-- the epoch it names (the caller caches those writes; a shard that changed hands since may have
-- moved on, and its old owner is fenced). An op run again under an id that has an outcome finds
-- the result but not its writes: refused (see replayed_error in lib.lua).
-- KEYS[1]  home results   KEYS[2]  home results, previous generation
-- KEYS[2 + 2i - 1], KEYS[2 + 2i]  shard i's epoch and state (i = 1: the home, then the others)
-- ARGV[1]  op id   ARGV[2]  the op's outcome (JSON)
-- ARGV[3]  replies to publish, JSON [[channel, message], ...] (empty when the owner publishes
--          them with its batch, see _pipeline.py)
-- ARGV[3 + 2i - 1], ARGV[3 + 2i]  shard i's owner epoch, and its writes, JSON
--          [[key, JSON state or '' to delete], ...]
-- Returns 1 when committed (now, or by an earlier call of the same commit: the op's result is
-- there). Error "ELSEWHERE i" when shard i > 1 has another owner now, error "FENCED ..." if
-- the home shard has, error "REPLAYED ..." if the op has a result that this commit did not
-- write (nothing written in each case).
local shards = (#KEYS - 2) / 2
if has_outcome(KEYS[1], KEYS[2], ARGV[1]) then
  for i = 1, shards do
    local owned = redis.call('GET', KEYS[2 + 2 * i - 1]) == ARGV[3 + 2 * i - 1]
    if owned and not writes_hold(KEYS[2 + 2 * i], cjson.decode(ARGV[3 + 2 * i])) then
      return replayed_error('op ' .. ARGV[1])
    end
  end
  return 1
end
for i = 1, shards do
  if redis.call('GET', KEYS[2 + 2 * i - 1]) ~= ARGV[3 + 2 * i - 1] then
    if i == 1 then
      return redis.error_reply('FENCED epoch ' .. ARGV[4] .. ' is no longer the owner')
    end
    return redis.error_reply('ELSEWHERE ' .. i)
  end
end
for i = 1, shards do
  -- The same state-write loop as decide.lua's (a Redis script cannot import code).
  write_states(KEYS[2 + 2 * i], ARGV[3 + 2 * i])
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
for _, reply in ipairs(cjson.decode(ARGV[3])) do
  publish(KEYS[1], reply[1], reply[2])
end
return 1
