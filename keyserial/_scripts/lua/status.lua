-- Read one shard's health in one atomic snapshot, for `keyserial status`. Writes nothing.
-- KEYS[1]  lease      KEYS[2]  epoch      KEYS[3]  progress    KEYS[4]  stream
-- KEYS[5]  dead-letter stream            KEYS[6]  results     KEYS[7]  results since
-- KEYS[8]  paused keys            KEYS[9]  inbox       KEYS[10] timers
-- Returns {owner token or '', lease PTTL (ms, -2 if none), epoch or '', progress or '',
--          backlog, first entry id after progress or '', dead letters, results stored,
--          results generation start or '', server time seconds, microseconds,
--          timers waiting, the next one's due time (ms) or '',
--          paused keys and their records (HGETALL: key, record, key, record, ...)}
-- backlog: the stream entries after the progress marker (entries not committed yet, and any
-- committed entry behind one that is not): XLEN less the committed entries not trimmed yet;
-- and the inbox's items, not moved into the stream yet.
local progress = redis.call('GET', KEYS[3]) or ''
local committed = 0
if progress ~= '' then
  -- At most a few dozen: the owner trims committed entries (see step.lua).
  local cursor = '-'
  while true do
    local page = redis.call('XRANGE', KEYS[4], cursor, progress, 'COUNT', 500)
    committed = committed + #page
    if #page < 500 or page[#page][1] == LARGEST_ID then break end
    cursor = '(' .. page[#page][1]
  end
end
local first = redis.call('XRANGE', KEYS[4], '-', '+', 'COUNT', 1)
if progress ~= '' then first = xrange_after(KEYS[4], progress, '+', 1) end
local oldest = ''
if #first > 0 then oldest = first[1][1] end
local now = redis.call('TIME')
return {
  redis.call('GET', KEYS[1]) or '',
  redis.call('PTTL', KEYS[1]),
  redis.call('GET', KEYS[2]) or '',
  progress,
  redis.call('XLEN', KEYS[4]) - committed + redis.call('LLEN', KEYS[9]),
  oldest,
  redis.call('XLEN', KEYS[5]),
  redis.call('HLEN', KEYS[6]),
  redis.call('GET', KEYS[7]) or '',
  now[1],
  now[2],
  redis.call('ZCARD', KEYS[10]),
  redis.call('ZRANGE', KEYS[10], 0, 0, 'WITHSCORES')[2] or '',
  -- An operator's list, a few keys at most (the owner reads it whole too, see runner.py).
  redis.call('HGETALL', KEYS[8]),
}
