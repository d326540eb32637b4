-- Cancel one pending timer of a shard for an operator (keyserial timers cancel), unless it has
-- fired: remove it, and answer each of its op ids with the outcome given, unless one has an
-- outcome already. Atomic with the owner's steps, which fire a timer with its removal in one
-- script: either this removes it, and it never fires, or it had fired, and this writes nothing.
-- KEYS[1]  the shard's timers      KEYS[2]  their items (timed)
-- KEYS[3]  the shard's results     KEYS[4]  its results, previous generation
-- ARGV[1]  the timer's id          ARGV[2]  its item, as the operator read it
-- ARGV[3]  the outcome its ops are answered with
-- ARGV[4..] the op ids its item carries
-- Returns 1 if cancelled now; 0 if it is not pending (fired, cancelled, or none by that id) or
-- its item is not the one read (nothing written either way).
if redis.call('HGET', KEYS[2], ARGV[1]) ~= ARGV[2] then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
for i = 4, #ARGV do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[4], ARGV[i]) == 0 then
    redis.call('HSET', KEYS[3], ARGV[i], ARGV[3])
  end
end
return 1
