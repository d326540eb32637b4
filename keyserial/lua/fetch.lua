-- Read the entries after the owner's cursor, for the shard's current owner only.
-- KEYS[1]  epoch      KEYS[2]  stream     KEYS[3]  horizon     KEYS[4]  results
-- ARGV[1]  the owner's epoch
-- ARGV[2]  cursor: the last entry id already read (exclusive)
-- ARGV[3]  how many entries at most
-- Returns {entries, done}: entries as XRANGE returns them, and done = {op id, outcome, ...} for
-- ops that already have a stored result (a resubmitted op id: reply with it, never run again).
-- Records the horizon (the highest entry id ever fetched) so that the next owner knows which
-- entries were running when an owner died. Error "FENCED ..." if another owner took over.
local function parse_id(id)
  local ms, seq = string.match(id, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local function id_gt(a, b)
  local am, as = parse_id(a)
  local bm, bs = parse_id(b)
  return am > bm or (am == bm and as > bs)
end

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
local entries = redis.call('XRANGE', KEYS[2], '(' .. ARGV[2], '+', 'COUNT', ARGV[3])
local done = {}
if #entries == 0 then
  return {entries, done}
end
local last = entries[#entries][1]
local horizon = redis.call('GET', KEYS[3])
if not horizon or id_gt(last, horizon) then
  redis.call('SET', KEYS[3], last)
end
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for i = 1, #fields, 2 do
    if fields[i] == 'ops' then
      local ok, ops = pcall(cjson.decode, fields[i + 1])
      if ok and type(ops) == 'table' then
        for _, envelope in ipairs(ops) do
          if type(envelope) == 'table' and type(envelope.id) == 'string' then
            local outcome = redis.call('HGET', KEYS[4], envelope.id)
            if outcome then
              done[#done + 1] = envelope.id
              done[#done + 1] = outcome
            end
          end
        end
      end
    end
  end
end
return {entries, done}
