-- Give a shard's lease up, so a standby takes over at once.
-- The horizon (the last entry the owner fetched) is kept either way: entries between progress
-- and the horizon may hold ops that already committed (an entry's ops commit one by one, and
-- progress only passes an entry once all of them have), so the next owner must look up their
-- stored outcomes before running anything again. What the release says is whose fault the
-- unfinished ops are:
--   clean ('1', a drained shutdown): not the ops' fault; the next owner replays the entries
--     without suspecting any op (no strike, no one-at-a-time);
--   failed ('0', the runner crashed on something): as after a crash, the first unfinished op is
--     suspected and takes a strike, so data that kills runners is dead-lettered in the end.
-- If the owner took pushed entries (see submit.lua), every entry in the stream (its inbox moved
-- in first, unless the shard is sealed) counts as fetched
-- (a drain that gave up may have left one running that no step recorded yet), and the record
-- that it takes pushes is dropped, so that a takeover counts nothing appended after the release.
-- The epoch moves on with the release: every late write of the releasing owner (a step still
-- on its way when a drain gave up and cancelled its runner) is fenced out, so none can lower
-- the horizon or commit behind the next owner's back.
-- KEYS[1]  lease      KEYS[2]  horizon      KEYS[3]  handover
-- KEYS[4]  the epoch of the owner that takes pushed entries      KEYS[5]  stream
-- KEYS[6]  epoch      KEYS[7]  inbox      KEYS[8]  the inbox's taken count
-- KEYS[9]  the shard's seal (a sealed shard's inbox holds strays, never moved in)
-- ARGV[1]  the owner's token      ARGV[2]  '1' clean, '0' failed
-- Returns 1 if released, 0 if the lease was not the caller's.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('INCR', KEYS[6])
local horizon = redis.call('GET', KEYS[2])
if redis.call('DEL', KEYS[4]) == 1 then
  horizon = fold_pushes(KEYS[2], KEYS[5], KEYS[7], KEYS[8], KEYS[9])
end
if ARGV[2] == '1' and horizon then
  redis.call('SET', KEYS[3], horizon)
else
  redis.call('DEL', KEYS[3])
end
return 1
