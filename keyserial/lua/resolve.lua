-- A participant holding keys for a cross-shard op asks the home shard what became of the
-- attempt. An attempt is named by the home shard's epoch when it began; once that epoch has
-- moved on (the coordinator died, froze or lost its lease) and the attempt has no decision, it
-- can never get a commit (every commit is fenced by the epoch), so the participant aborts it:
-- set-if-absent in one script, so a commit and an abort can never both win.
-- Not fenced: aborting is always safe, and this only writes an abort.
-- KEYS[1]  the home shard's epoch   KEYS[2]  its results   KEYS[3]  their previous generation
-- ARGV[1]  op id   ARGV[2]  attempt (the home epoch it began in)
-- Returns the decision (JSON), or nil while the attempt is undecided and its coordinator owns
-- the home shard.
local field = ARGV[1] .. '#' .. ARGV[2] .. '#d'
local decision = redis.call('HGET', KEYS[2], field) or redis.call('HGET', KEYS[3], field)
if decision then
  return decision
end
if redis.call('GET', KEYS[1]) == ARGV[2] then
  return nil
end
decision = '{"abort":"the coordinator lost the home shard"}'
redis.call('HSET', KEYS[2], field, decision)
return decision
