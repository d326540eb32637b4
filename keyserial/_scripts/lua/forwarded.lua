-- Take the first items of a retired shard's inbox out once the owner of its heir has forwarded
-- them (see _worker/strays.py), if none was taken out since it read them: another worker that
-- forwarded them too (the heir changing owner) takes them out once, and no item it did not read
-- goes. (They are forwarded from the inbox, never moved into the stream: a client user, who may
-- read streams but not inboxes, never sees their op ids before they are in their new shard.)
-- Only the worker user may run it.
-- KEYS[1]  the shard's inbox      KEYS[2]  the inbox's taken count
-- ARGV[1]  the taken count read with the items      ARGV[2]  how many of them were forwarded
-- Returns 1 if it took them out, 0 if the taken count had moved on (nothing written).
if (redis.call('GET', KEYS[2]) or '0') ~= ARGV[1] then
  return 0
end
redis.call('LTRIM', KEYS[1], tonumber(ARGV[2]), -1)
redis.call('SET', KEYS[2], string.format('%d', tonumber(ARGV[1]) + tonumber(ARGV[2])))
return 1
