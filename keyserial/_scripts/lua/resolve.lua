-- A participant holding keys for a cross-shard op asks the home shard what became of the
-- attempt. An attempt is named by the home shard's epoch when it began; once that epoch has
-- moved on (the coordinator died, froze or lost its lease) and the attempt has no decision, it
-- can never get a commit (every commit is fenced by the epoch), so the participant aborts it:
-- set-if-absent in one script, so a commit and an abort can never both win.
-- Not fenced: aborting a past attempt is always safe, and this only writes an abort. An attempt
-- past the home epoch has not begun: no coordinator asked for it (a forged or garbled request),
-- and nothing is written for it, so the attempt, once it begins, is not aborted in advance.
-- KEYS[1]  the home shard's epoch   KEYS[2]  its results   KEYS[3]  their previous generation
-- ARGV[1]  op id   ARGV[2]  attempt (the home epoch it began in)
-- Returns the decision (JSON), or nil while the attempt is undecided and its coordinator owns
-- the home shard; error "AHEAD ..." if the attempt is past the home epoch (nothing written).
local field = ARGV[1] .. '#' .. ARGV[2] .. '#d'
local decision = redis.call('HGET', KEYS[2], field) or redis.call('HGET', KEYS[3], field)
if decision then
  return decision
end
local epoch, attempt = tonumber(redis.call('GET', KEYS[1]) or '0'), tonumber(ARGV[2])
if epoch == attempt then
  return nil
end
if epoch < attempt then
  return redis.error_reply('AHEAD attempt ' .. ARGV[2] .. ' has not begun: the home epoch is '
    .. epoch)
end
decision = '{"abort":"the coordinator lost the home shard"}'
redis.call('HSET', KEYS[2], field, decision)
return decision
