-- Commit the decision of a cross-shard op's attempt on its home shard (fenced), only if the
-- attempt has no decision yet: set-if-absent on one field decides the race with a participant
-- that gave up on the attempt, so exactly one of commit and abort wins. (The attempt is the
-- epoch it began in, so a participant only gives up once that epoch is over, and then the fence
-- refuses this script first.)
-- When it wins, the home shard's own writes and the op's result commit with it, atomically, and
-- the notices go out (the output gate: participants and callers hear only committed decisions).
-- KEYS[1]  epoch      KEYS[2]  state      KEYS[3]  results    KEYS[4]  results, previous
-- ARGV[1]  the owner's epoch   ARGV[2]  op id   ARGV[3]  attempt   ARGV[4]  decision (JSON)
-- ARGV[5]  home writes, JSON [[key, JSON state or '' to delete], ...]
-- ARGV[6]  the op's outcome (JSON)
-- ARGV[7]  notices, JSON [[channel, message], ...]
-- Returns {1} when this decision won, also when a first call of this same script did (its
-- reply was lost, the call is sent again: only the attempt's own coordinator ever records a
-- commit for it, so a commit found there, with the home writes holding, is this one); {0, the
-- decision that was there} otherwise (nothing written). Error "FENCED ..." if another owner
-- took over; error "REPLAYED ..." if the op has a result that this attempt did not write (it
-- ran again under an id that has an outcome: see replayed_error in lib.lua; nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
local field = ARGV[2] .. '#' .. ARGV[3] .. '#d'
local earlier = redis.call('HGET', KEYS[3], field) or redis.call('HGET', KEYS[4], field)
if earlier then
  if earlier ~= ARGV[4] then
    return {0, earlier}
  end
  if not writes_hold(KEYS[2], cjson.decode(ARGV[5])) then
    return replayed_error('op ' .. ARGV[2])
  end
  return {1}
end
if has_outcome(KEYS[3], KEYS[4], ARGV[2]) then
  return replayed_error('op ' .. ARGV[2])
end
redis.call('HSET', KEYS[3], field, ARGV[4])
-- One command per write: an op has few keys (step.lua, which writes a whole batch, groups them).
write_states(KEYS[2], ARGV[5])
redis.call('HSET', KEYS[3], ARGV[2], ARGV[6])
for _, notice in ipairs(cjson.decode(ARGV[7])) do
  publish(KEYS[1], notice[1], notice[2])
end
return {1}
