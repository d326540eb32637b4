-- Read whether a sealed shard is quiet, in one snapshot. Writes nothing.
-- KEYS[1]  stream      KEYS[2]  seal record      KEYS[3]  drained record
-- Returns {seal record or '', drained record or '', the stream's last generated id or '0-0'}.
local last = '0-0'
local info = redis.pcall('XINFO', 'STREAM', KEYS[1])
if type(info) == 'table' and not info.err then
  for i = 1, #info, 2 do
    if info[i] == 'last-generated-id' then
      last = info[i + 1]
    end
  end
end
return {redis.call('GET', KEYS[2]) or '', redis.call('GET', KEYS[3]) or '', last}
