-- A sealed shard's owner records that every entry up to one has taken effect and that nothing
-- of the shard is under way (no op running, no keys held for another shard's op).
-- KEYS[1]  epoch      KEYS[2]  the shard's drained record
-- ARGV[1]  the owner's epoch
-- ARGV[2]  the last entry it has taken in, and how many ops it has run: '<entry id> <count>'
-- Returns 1; the error "FENCED <epoch>" when another owner holds the shard (nothing written).
local epoch = redis.call('GET', KEYS[1])
if epoch ~= ARGV[1] then
  return redis.error_reply('FENCED ' .. (epoch or 'none'))
end
redis.call('SET', KEYS[2], ARGV[1] .. ' ' .. ARGV[2])
return 1
