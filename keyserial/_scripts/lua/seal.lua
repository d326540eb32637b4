-- Seal a shard of the layout a reshard leaves: from now on the submit script refuses clients'
-- pushes to its inbox (RESHARDED). What the inbox holds was pushed before: it is moved into the
-- stream, and the record names the last entry there (the stream's last generated id: entries
-- trimmed since still count). Sealing again changes nothing.
-- KEYS[1]  the shard's stream      KEYS[2]  its seal record
-- KEYS[3]  its inbox               KEYS[4]  the inbox's taken count
-- ARGV[1]  the layout its ops go to now, JSON [<generation>, <shards>]
-- Returns the seal record, JSON {"to": [<generation>, <shards>], "last": "<entry id>"}.
local sealed = redis.call('GET', KEYS[2])
if sealed then
  return sealed
end
move_inbox(KEYS[3], KEYS[4], KEYS[1])
local last = last_generated_id(KEYS[1])
sealed = '{"to":' .. ARGV[1] .. ',"last":"' .. last .. '"}'
redis.call('SET', KEYS[2], sealed)
return sealed
