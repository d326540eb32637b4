-- Move what a client pushed to a retired shard's inbox (a client routing by the shard count it
-- read before a reshard, pushing with a plain RPUSH) into its stream, where the owner of the
-- shard's heir forwards it (see _worker/strays.py). Only the worker user may run it.
-- KEYS[1]  the shard's inbox      KEYS[2]  the inbox's taken count      KEYS[3]  its stream
-- ARGV[1]  how many items to move at most
-- Returns how many it moved.
local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
return #move_items(KEYS[1], KEYS[2], KEYS[3], items)
