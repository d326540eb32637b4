-- Whether entries a client pushed (see submit.lua) are still in the shard's inbox or stream, for
-- the client's sweep of ops whose reply is overdue: one gone with no outcome was lost to a
-- failover, and is pushed again. Writes nothing.
-- KEYS[1]  the shard's inbox, ks:{<ns>:<shard>}:inbox (the script reads the inbox's taken count,
--          :inbox:taken, the stream, :stream, and the timers' items, :timed, named after it: a
--          client user may read them)
-- ARGV     per entry: its place, the server's clock when it was pushed (ms) and the items that
--          were ahead of it in the inbox then (as submit.lua returned them); for a delayed
--          entry, its due time instead of that clock (it is moved into the stream at or after it)
-- Returns a list, per entry: 1 if it is there, else 0. An item still in the inbox is there if
-- its place is (a failover that lost it and let others take its place is told apart once they
-- have moved on); an item moved into the stream is there while the entry of its place is (moved
-- in after it was pushed, so at or after its clock, behind the items that were ahead of it and
-- those moved in the same millisecond before it was pushed: a step moves at most a batch).
local shard = string.match(KEYS[1], '^(ks:{[^}]*}):inbox$')
local stream, timed = shard .. ':stream', shard .. ':timed'
local taken = tonumber(redis.call('GET', shard .. ':inbox:taken') or '0')
local length = redis.call('LLEN', KEYS[1])
local found = {}
for at = 1, #ARGV, 3 do
  local place, since, ahead = tonumber(ARGV[at]), ARGV[at + 1], tonumber(ARGV[at + 2])
  local there = 0
  if place > taken and place <= taken + length then
    there = 1
  elseif place <= taken and redis.call('HGET', timed, string.format('%016d', place)) then
    there = 1  -- (a delayed entry, waiting in the shard's timers: see lib.lua)
  elseif place <= taken then
    for _, entry in ipairs(redis.call('XRANGE', stream, since, '+', 'COUNT', ahead + 1025)) do
      local fields = entry[2]
      for i = 1, #fields, 2 do
        if fields[i] == 'p' and fields[i + 1] == ARGV[at] then
          there = 1
        end
      end
    end
  end
  found[#found + 1] = there
end
return found
