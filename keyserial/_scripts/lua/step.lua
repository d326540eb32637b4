-- One step of a shard's owner: commit the ops finished since the last step, move the entries it
-- took in from pushes out of the shard's inbox into its stream, then fetch the next entries
-- (moving them in from the inbox first). Under load a shard costs one round trip per batch.
--
-- The commit is atomic and fenced: the state writes, results and progress of the finished ops,
-- then their replies (the output gate: nothing is replied before it is committed).
-- The fetch returns entries after the owner's cursor, the stored outcome of any op id that
-- already has one (a resubmitted op: reply with it, never run it again), and the committed
-- state of every key the entries name (the owner ignores keys it already caches).
--
-- KEYS[1]  epoch      KEYS[2]  state      KEYS[3]  progress    KEYS[4]  stream
-- KEYS[5]  results    KEYS[6]  results, previous generation    KEYS[7]  dead-letter stream
-- KEYS[8]  horizon    KEYS[9]  when the current results generation began
-- KEYS[10] the epoch of the owner that takes pushed entries (see submit.lua, acquire.lua)
-- KEYS[11] the shard's seal, once a reshard sealed it (see seal.lua)
-- KEYS[12] the shard's paused keys (keyserial keys pause)
-- KEYS[13] the shard's held hash: the keys it holds for other shards' cross-shard ops, by
--          part ('<op id>#<home>.<attempt>': the grant), from the step that records a hold to the
--          one that applies or releases it
-- KEYS[14] the shard's inbox, where clients push entries (see submit.lua)
-- KEYS[15] the inbox's taken count: the items moved out of it into the stream so far
-- KEYS[15 + 2j - 1], KEYS[15 + 2j]  the epoch and state of the j-th other shard whose keys
--          the commit's part 10 writes (a standalone server only: a cluster keeps each script to
--          one slot)
-- KEYS after those: results hashes of earlier layouts' shards, in pairs (see ARGV[15]; a
--          standalone server only too)
-- ARGV[1]  the owner's epoch
-- ARGV[2]  new progress: id of the last entry whose ops have all finished, or '' to keep it
-- ARGV[3]  '1': start a new results generation first if the current one is a retention period
--          old by the server's clock (ARGV[8]), and no entry past progress is older than it: the
--          previous one is dropped, the current one becomes the previous; '0' not. (An entry
--          past progress may be replayed, and its ops' results are needed then: a result stored
--          before the current generation began belongs to an entry appended before that.)
-- ARGV[4]  cursor: the last entry id already fetched (exclusive)
-- ARGV[5]  how many entries to fetch (0: commit only)
-- ARGV[6]  '1': the step commits; '0': it has nothing to commit. The commit follows ARGV[15]
--   (then come the pushed items of ARGV[13]): first the sizes of its twelve parts, one
--   argument each, then the values of each part, in this order:
--   1. state writes, (key, JSON state) pairs; 2. state deletes, keys;
--   3. outcomes, (op id, JSON outcome) pairs; 4. records of ops answered but not stored,
--   ('<op id>#u', JSON) pairs, written over freely; 5. decisions of attempts this owner
--   coordinates, ('<op id>#<attempt>#d', decision) pairs, each written once: a different one
--   there already (an abort) means the attempt's epoch is over (see docs/multi-key.md);
--   6. holds of this shard's keys for cross-shard ops, ('<op id>#<home>.<attempt>', grant)
--   pairs, in the held hash: each recorded unless its part has an outcome here already (it was
--   applied or released: the request was sent again), then skipped; 7. holds applied or
--   released, fields of the held hash to delete; 8. dead letters, (entry id, reason, raw entry)
--   triples ('+<n>' for the entry id of the n-th pushed item of ARGV[13], which the step moves in); 9. entries whose ops have all committed, past progress: removed from the stream;
--   10. the writes of cross-shard ops (their results are in 3) to other shards the same worker
--   owns, each fenced by its owner's epoch: per shard j, epoch, its writes' count and its
--   deletes' count, then its writes and deletes as in 1 and 2; 11. timers the ops set,
--   (timer id, delay in ms, inbox item) triples, each due at the step's clock plus its delay;
--   12. timers the ops cancelled, (timer id, outcome) pairs: each removed, and its op id
--   answered with the outcome unless it has one. (Sizes in this order; values: 1 to 9, then
--   11 and 12, then 10.)
--   (Values the script hands to HSET and HMGET as they come: decoding one JSON argument cost
--   it about a microsecond per op.)
-- ARGV[7]  '1' while replaying (after a takeover, up to the previous owner's horizon: those
--          entries are fetched again, so the horizon is only raised, and some of their ops may
--          have committed, so every stored outcome is looked up); '0' otherwise (every fetched
--          entry is past the horizon, so it is set without reading it)
-- ARGV[8]  the results retention in milliseconds
-- ARGV[9]  the last committed entry id not trimmed from the stream yet, or '' (none)
-- ARGV[10] '1': trim through ARGV[9] now; '0': only if the step fetches nothing new (the owner
--          trims every so many entries, and otherwise at most once per idle_poll while entries
--          come pushed: a shard idle that long has XLEN = its backlog)
-- ARGV[11] '1': the owner holds every state of the shard (loaded when it took the shard over),
--          so none is read
-- ARGV[12] replies (and the messages of holds and decisions) to publish once committed, JSON
--          [[channel, message], ...], or ''. (On keyserial's own connection the owner publishes
--          the replies of several steps of one batch itself, one message per channel, once they
--          have returned: see pipeline.py.)
-- ARGV[13] '<place> <keep>': the place of the first item the owner took in from a push (not
--          fetched) since its last step, and per item '1' to move its entry into the stream, or
--          '0' if its ops have all committed (with this step or before: it is taken out of the
--          inbox and appended nowhere, as an entry whose ops all committed leaves the stream); or
--          '' (it took none). Those items are the ARGV after the commit's, to the last, as they
--          were pushed. A push is a hint anyone allowed to publish may forge: the inbox must hold
--          exactly these items first (compared as they are: Lua strings are compared whole), or
--          nothing is written. The horizon is raised to the last entry kept, or to the last
--          entry fetched if that comes later (never while replaying: no push is taken then).
-- ARGV[14] '1': this owner takes pushed entries from now on, so KEYS[10] records its epoch (a
--          takeover then counts every entry in the stream, and in the inbox, as one it may
--          have run)
-- ARGV[15] the op ids whose outcomes this commit records (parts 3 and 4) to look up in the
--          layouts before a reshard, JSON [[i, [op id, ...]], ...]: KEYS[i] and KEYS[i + 1]
--          are the results hashes (current and previous generation) of one earlier layout's
--          shard, where each of those ops was homed; or '' (none; optional). An outcome there
--          refuses the step (REPLAYED): the op ran again after a reshard, and its owner starts
--          again, replaying, when it looks every op up in those layouts before running it.
-- Entries with the field fresh = '1' carry op ids appended for the first time (see the wire
-- format), so their stored outcomes are not looked up, except while replaying.
-- A step that fetches first moves the inbox's items into the stream (a delayed one into the
-- shard's timers, see lib.lua), then fires the timers due, unless the shard is sealed.
-- Returns, when it fetched and moved nothing, skipped no hold and found no timer waiting, the
-- inbox's taken count if it asked to fetch, else {}; otherwise {entries, done, states, seal,
-- paused, skipped, moved, taken, next timer, timers}: entries as XRANGE returns them;
-- done = {op id, outcome, ...}; states = {key, JSON state or '', ...}; seal = the seal record when
-- entries were fetched, or items wait in the inbox, and the shard is sealed, else false; paused =
-- the shard's paused hash (HGETALL) when entries were fetched. (Both read with the entries: an owner that has not heard
-- of a seal or a pause yet judges every fetched entry by it.) skipped = the fields of the part 6
-- holds not recorded; moved = the ids of the entries the pushed items of ARGV[13] became, in
-- order ('' for one not kept); taken = the inbox's taken count after the step (false if it neither moved nor fetched);
-- next timer = the ms until the shard's next timer is due by the server's clock (0: one is due
-- already, which the next fetch fires), false if none waits or the step did not fetch;
-- timers = how many wait (0 if the step did not fetch, or found the shard sealed).
-- Error "FENCED ..." (nothing written) if
-- another owner took over: the epoch moved on; error "UNCONFIRMED ..." (nothing written) if the
-- inbox does not hold the pushed items of ARGV[13] as pushed (nor, the step being sent again,
-- the stream their entries), or the stream holds an entry after the cursor they would overtake
-- (one appended to the stream itself), or has no id left for them, or the shard is sealed (no push
-- follows a seal: the submit script refuses appends there; the owner starts again, sealed);
-- error "REPLAYED ..." (nothing written) if an outcome of part 3 is stored already and the step is
-- not this same step sent again, or another decision of a part 5 attempt is; error "ELSEWHERE j"
-- (nothing written) if the j-th other shard of part 10 has another owner now; error
-- "RESTARTED ..." (after the commit) if the new progress is the largest id (see below).
-- (parse_id, id_gt, has_outcome, replayed_error, xrange_after and LARGEST_ID come from lib.lua.)

-- One command for many arguments (a few per step, not one per op), in bounded chunks: unpack()
-- has a stack limit. (The chunk is even, so field-value pairs never split.)
local CHUNK = 1000
-- ``command`` on ``key`` with ARGV[first] to ARGV[last] (none: no call).
local function multi(command, key, first, last)
  for from = first, last, CHUNK do
    redis.call(command, key, unpack(ARGV, from, math.min(from + CHUNK - 1, last)))
  end
end
local function hmget(key, fields)
  local values = {}
  for first = 1, #fields, CHUNK do
    local last = math.min(first + CHUNK - 1, #fields)
    for _, value in ipairs(redis.call('HMGET', key, unpack(fields, first, last))) do
      values[#values + 1] = value
    end
  end
  return values
end

if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end

-- The commit's parts (see ARGV[6]): where the values of each start in ARGV, and how many there
-- are. A shard's writes are {sets, n_sets, deletes, n_deletes}. (Plain arithmetic: the sizes
-- parsed from one text, with a table per part, cost a step more than the commands it sends.)
local commit = ARGV[6] == '1'
local size = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0}
if commit then
  for i = 1, 12 do
    size[i] = tonumber(ARGV[15 + i])
  end
end
local home_writes = {commit and 28 or 16, size[1], 0, size[2]}
home_writes[3] = home_writes[1] + 2 * size[1]
local stored_first = home_writes[3] + size[2]  -- parts 3 to 5: pairs for the results hash
local results_first, n_results = stored_first, size[3]
local decisions_first, n_decisions = stored_first + 2 * (size[3] + size[4]), size[5]
local stored_last = decisions_first + 2 * n_decisions - 1
local holds_first, n_holds = stored_last + 1, size[6]
local released_first, n_released = holds_first + 2 * n_holds, size[7]
local dead_first, n_dead = released_first + n_released, size[8]
local passed_first, n_passed = dead_first + 3 * n_dead, size[9]
local timers_first, n_timers = passed_first + n_passed, size[11]
local cancels_first, n_cancels = timers_first + 3 * n_timers, size[12]
local pushed_at = cancels_first + 2 * n_cancels
local others = {}
for _ = 1, size[10] do
  local n_sets, n_deletes = tonumber(ARGV[pushed_at + 2]), tonumber(ARGV[pushed_at + 3])
  local first = pushed_at + 4
  others[#others + 1] = {tonumber(ARGV[pushed_at]), ARGV[pushed_at + 1],
                         {first, n_sets, first + 2 * n_sets, n_deletes}}
  pushed_at = first + 2 * n_sets + n_deletes
end

-- Confirm the pushed items before anything that ran them commits: the inbox holds them first,
-- as pushed. (Its first item is at the place the owner took the first at: only this owner's
-- steps have moved items out since it learned the taken count, or it would be fenced, and a
-- seal, which moves the inbox in, refuses the step below.)
local pushed = {}
for at = pushed_at, #ARGV do
  pushed[#pushed + 1] = ARGV[at]
end
local pushed_place, keep = string.match(ARGV[13], '^(%d+) ([01]+)$')
pushed_place = tonumber(pushed_place)
-- The entries of the pushed items kept, after the cursor, if a first sending of this same step
-- moved them in already (its reply was lost: the taken count is past them), each with its place
-- and as it was moved in: their ids ('' for an item not kept).
local function moved_before()
  if tonumber(redis.call('GET', KEYS[15]) or '0') < pushed_place + #pushed - 1 then
    return nil
  end
  local kept = {}
  for i = 1, #pushed do
    if string.sub(keep, i, i) == '1' then
      kept[#kept + 1] = i
    end
  end
  local entries = #kept > 0 and xrange_after(KEYS[4], ARGV[4], '+', #kept) or {}
  if #entries ~= #kept then
    return nil
  end
  local ids = {}
  for i = 1, #pushed do
    ids[i] = ''
  end
  for n, entry in ipairs(entries) do
    local i = kept[n]
    local fields = inbox_entry(pushed[i], string.format('%d', pushed_place + i - 1))
    if #entry[2] ~= #fields then
      return nil
    end
    for j = 1, #fields do
      if entry[2][j] ~= fields[j] then
        return nil
      end
    end
    ids[i] = entry[1]
  end
  return ids
end
local moved_already = nil
local function unconfirmed()
  local held = redis.call('LRANGE', KEYS[14], 0, #pushed - 1)
  local same = #held == #pushed
  for i = 1, same and #held or 0 do
    if held[i] ~= pushed[i] then
      same = false
      break
    end
  end
  if same and #xrange_after(KEYS[4], ARGV[4], '+', 1) > 0 then
    -- (An entry appended to the stream itself, by hand or by a client of an earlier release:
    -- the pushed ones ran ahead of it.)
    return 'the stream holds an entry after the cursor that the pushed items overtook'
  elseif same then
    return nil
  end
  moved_already = moved_before()
  if moved_already then
    return nil
  end
  if #held ~= #pushed then
    return 'the inbox holds ' .. #held .. ' items where ' .. #pushed .. ' came pushed'
  end
  return 'the items from place ' .. pushed_place .. ' are not in the inbox as pushed'
end
if ARGV[13] ~= '' then
  local problem = unconfirmed()
  if not problem and redis.call('EXISTS', KEYS[11]) == 1 then
    problem = 'the shard is sealed for a reshard'
  end
  if problem then
    return redis.error_reply('UNCONFIRMED ' .. problem .. '; nothing was written')
  end
end

-- The stored outcomes of the op ids among ``ids`` that have one, in either generation:
-- {op id, outcome, ...}.
local function stored_outcomes(ids)
  local found, missing = {}, {}
  for i, outcome in ipairs(hmget(KEYS[5], ids)) do
    if outcome then
      found[#found + 1] = ids[i]
      found[#found + 1] = outcome
    else
      missing[#missing + 1] = ids[i]
    end
  end
  for i, outcome in ipairs(hmget(KEYS[6], missing)) do
    if outcome then
      found[#found + 1] = missing[i]
      found[#found + 1] = outcome
    end
  end
  return found
end

-- Whether every write of ``writes`` (see the commit's parts) already holds in ``hash``.
local function writes_hold(hash, writes)
  local sets, n_sets, deletes, n_deletes = unpack(writes)
  for i = sets, sets + 2 * n_sets - 1, 2 do
    if redis.call('HGET', hash, ARGV[i]) ~= ARGV[i + 1] then
      return false
    end
  end
  for i = deletes, deletes + n_deletes - 1 do
    if redis.call('HEXISTS', hash, ARGV[i]) == 1 then
      return false
    end
  end
  return true
end
-- Whether the j-th other shard of part 10 is still owned by ``epoch``.
local function owns_other(j, epoch)
  return redis.call('GET', KEYS[15 + 2 * j - 1]) == epoch
end
-- Whether the part 10 writes hold on every other shard still owned by the epoch they name (a
-- shard that changed hands since may have moved on, and its old owner is fenced).
local function others_hold(others)
  for _, other in ipairs(others) do
    if owns_other(other[1], other[2]) and not writes_hold(KEYS[15 + 2 * other[1]], other[3]) then
      return false
    end
  end
  return true
end

-- Commit: the state writes, then (in the current generation) the results and dead letters.
-- An outcome is written once (see replayed_error): a step whose outcomes are all stored, and
-- whose writes all hold, was sent again after its reply was lost, and commits nothing more.
if commit then
  local ids = {}
  for i = results_first, results_first + 2 * n_results - 1, 2 do
    ids[#ids + 1] = ARGV[i]
  end
  local stored = stored_outcomes(ids)
  if #stored > 0 then
    if #stored < 2 * #ids or not writes_hold(KEYS[2], home_writes) or not others_hold(others) then
      return replayed_error('op ' .. stored[1])
    end
    commit = false
  end
end
-- An op id with an outcome in a layout before a reshard ran there (see ARGV[15]).
local function earlier_outcome(checks)
  for _, check in ipairs(checks) do
    for _, hash in ipairs({KEYS[check[1]], KEYS[check[1] + 1]}) do
      for i, outcome in ipairs(hmget(hash, check[2])) do
        if outcome then
          return check[2][i]
        end
      end
    end
  end
  return nil
end
if commit and ARGV[15] and ARGV[15] ~= '' then
  local ran = earlier_outcome(cjson.decode(ARGV[15]))
  if ran then
    return replayed_error('op ' .. ran .. ' (in a layout before a reshard)')
  end
end
-- The timers of parts 11 and 12: each set due at the server's clock plus its delay, under its
-- id; each cancelled removed, and its op answered with the outcome given, unless it has one
-- (it ran before the op that cancels it).
local function set_timers(first, count, cancels, cancelled)
  if count == 0 and cancelled == 0 then
    return
  end
  local timers, timed = timer_keys(KEYS[4])
  local now = now_ms()
  for i = first, first + 3 * count - 1, 3 do
    redis.call('ZADD', timers, now + tonumber(ARGV[i + 1]), ARGV[i])
    redis.call('HSET', timed, ARGV[i], ARGV[i + 2])
  end
  for i = cancels, cancels + 2 * cancelled - 1, 2 do
    redis.call('ZREM', timers, ARGV[i])
    redis.call('HDEL', timed, ARGV[i])
    if not has_outcome(KEYS[5], KEYS[6], ARGV[i]) then
      redis.call('HSET', KEYS[5], ARGV[i], ARGV[i + 1])
    end
  end
end
-- The cross-shard records' conditions, before anything is written.
local function record_refusal()
  for _, other in ipairs(others) do
    if not owns_other(other[1], other[2]) then
      return 'ELSEWHERE ' .. other[1] .. ' another worker owns a shard this step writes for a'
        .. ' cross-shard op; nothing was written'
    end
  end
  for i = decisions_first, decisions_first + 2 * n_decisions - 1, 2 do
    local earlier = redis.call('HGET', KEYS[5], ARGV[i]) or redis.call('HGET', KEYS[6], ARGV[i])
    if earlier and earlier ~= ARGV[i + 1] then
      return 'REPLAYED attempt ' .. ARGV[i] .. ' has a decision already; nothing was written'
    end
  end
  return nil
end
if commit then
  local refusal = record_refusal()
  if refusal then
    return redis.error_reply(refusal)
  end
end
-- The pushed items leave the inbox first, those kept moving into the stream: the first writes,
-- so that a stream with no id left for them (an entry under the largest id, see RESTARTED below)
-- refuses the step before any. (The first pushed item's place is in ARGV[13], so the taken count
-- before them is known.)
local moved, taken = moved_already, nil
if not moved and #pushed > 0 then
  moved, taken = take_items(KEYS[14], KEYS[15], KEYS[4], pushed, keep, pushed_place - 1)
  if not moved then
    return redis.error_reply('UNCONFIRMED the stream has no id left for the pushed items (an'
      .. ' entry under the largest id); nothing was written')
  end
end
moved = moved or {}
local function write_states(hash, writes)
  local sets, n_sets, deletes, n_deletes = unpack(writes)
  multi('HSET', hash, sets, sets + 2 * n_sets - 1)
  multi('HDEL', hash, deletes, deletes + n_deletes - 1)
end
if commit then
  write_states(KEYS[2], home_writes)
  for _, other in ipairs(others) do
    write_states(KEYS[15 + 2 * other[1]], other[3])
  end
end
-- Results expire a generation at a time: no expiry to record per result. (UNLINK frees the
-- dropped generation off the main thread. A step sent again after a lost reply does not
-- rotate twice: the generation it began is younger than the retention.)
local function rotation_due()
  local now = redis.call('TIME')
  local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
  local since = tonumber(redis.call('GET', KEYS[9]) or '0')
  if now_ms - since < tonumber(ARGV[8]) then
    return nil
  end
  local passed = ARGV[2]
  if passed == '' then
    passed = redis.call('GET', KEYS[3]) or '0-0'
  end
  local oldest = xrange_after(KEYS[4], passed, '+', 1)[1]
  if oldest and parse_id(oldest[1]) < since then
    return nil
  end
  return now_ms
end
if ARGV[3] == '1' then
  local now_ms = rotation_due()
  if now_ms then
    redis.call('UNLINK', KEYS[6])
    if redis.call('EXISTS', KEYS[5]) == 1 then
      redis.call('RENAME', KEYS[5], KEYS[6])
    end
    redis.call('SET', KEYS[9], now_ms)
  end
end
-- A hold is recorded unless its attempt's part here is over: a request sent again after its
-- answer (a message replayed) holds nothing.
local skipped = {}
if commit then
  for i = holds_first, released_first - 1, 2 do
    if has_outcome(KEYS[5], KEYS[6], ARGV[i]) then
      skipped[#skipped + 1] = ARGV[i]
    else
      redis.call('HSET', KEYS[13], ARGV[i], ARGV[i + 1])
    end
  end
  multi('HSET', KEYS[5], stored_first, stored_last)
  for i = dead_first, dead_first + 3 * n_dead - 1, 3 do
    local entry = ARGV[i]
    if string.sub(entry, 1, 1) == '+' then  -- (the n-th pushed item's entry, moved in above)
      entry = moved[tonumber(string.sub(entry, 2))]
    end
    redis.call('XADD', KEYS[7], 'MAXLEN', '~', 10000, '*',
      'entry', entry, 'reason', ARGV[i + 1], 'raw', ARGV[i + 2])
  end
  multi('XDEL', KEYS[4], passed_first, passed_first + n_passed - 1)
  set_timers(timers_first, n_timers, cancels_first, n_cancels)
end
-- A hold ends even with a step taken as sent again (its part's outcome stored by the first).
if ARGV[6] == '1' then
  multi('HDEL', KEYS[13], released_first, released_first + n_released - 1)
end

-- Fetch (moving in up to as many more items first, unless the shard is sealed: its seal moved
-- in what was pushed before it, and what a client pushed since with a plain RPUSH is a stray its
-- owner forwards from the inbox, where a client user cannot read its op id), then set progress,
-- horizon and who takes pushes (in one command), and trim.
local last_kept = nil  -- (the last pushed item moved into the stream)
for i = #moved, 1, -1 do
  if moved[i] ~= '' then
    last_kept = moved[i]
    break
  end
end
local cursor = last_kept or ARGV[4]
local entries, done, states = {}, {}, {}
local fetching = tonumber(ARGV[5]) > 0
local seal = nil  -- (the seal record, read at most once a step: false where there is none)
local next_timer, timers_waiting = nil, 0  -- (the ms until the next timer is due; how many)
if fetching then
  local items = redis.call('LRANGE', KEYS[14], 0, tonumber(ARGV[5]) - 1)
  if #items > 0 then
    seal = redis.call('GET', KEYS[11])
  end
  if #items > 0 and not seal then
    local _
    _, taken = move_items(KEYS[14], KEYS[15], KEYS[4], items, taken)
  end
  -- Timers due fire behind what the inbox held (a sealed shard fires none: a reshard moves its
  -- timers to the new layout's shards).
  if seal == nil and redis.call('EXISTS', timer_keys(KEYS[4])) > 0 then
    seal = redis.call('GET', KEYS[11])
  end
  if not seal then
    local _
    _, next_timer, timers_waiting = fire_timers(KEYS[4], tonumber(ARGV[5]))
  end
  entries = xrange_after(KEYS[4], cursor, '+', ARGV[5])
end
local horizon = nil
if #entries == 0 and last_kept then
  horizon = last_kept
elseif #entries > 0 then
  horizon = entries[#entries][1]
  if ARGV[7] == '1' then
    local stored_horizon = redis.call('GET', KEYS[8])
    if stored_horizon and not id_gt(horizon, stored_horizon) then
      horizon = nil
    end
  end
end
local writes = {}
local function set(key, value)
  writes[#writes + 1] = key
  writes[#writes + 1] = value
end
if ARGV[2] ~= '' then
  set(KEYS[3], ARGV[2])
end
if horizon then
  set(KEYS[8], horizon)
end
if ARGV[14] == '1' then
  set(KEYS[10], ARGV[1])
end
if #writes > 0 then
  redis.call('MSET', unpack(writes))
end
if ARGV[12] ~= '' then
  for _, reply in ipairs(cjson.decode(ARGV[12])) do
    publish(KEYS[1], reply[1], reply[2])
  end
end
-- An entry appended under the largest id there is (by hand: XADD takes any larger id) leaves
-- no id for the next append. Once it has committed, so has every entry: the stream (if no
-- append has followed yet: this step may be sent again), progress and horizon start again as
-- a new shard's, and the owner starts again from them. Likewise once the owner has taken it in
-- and the stream is empty: a sealed shard forwards what follows its seal and deletes it, so its
-- progress never reaches that entry, and the old shards still draining could append it no
-- grant request.
if ARGV[2] == LARGEST_ID or (ARGV[4] == LARGEST_ID and redis.call('XLEN', KEYS[4]) == 0) then
  if last_generated_id(KEYS[4]) == LARGEST_ID then
    redis.call('DEL', KEYS[4])
  end
  redis.call('DEL', KEYS[3], KEYS[8])
  return redis.error_reply('RESTARTED the stream held an entry with the largest id, '
    .. LARGEST_ID .. ', so no append could follow it; every entry had committed, and the stream'
    .. ' starts again')
end
if ARGV[9] ~= '' and (ARGV[10] == '1' or not fetching or #entries == 0) then
  -- Drop committed entries, so XLEN counts the entries not committed yet.
  local ms, seq = parse_id(ARGV[9])
  redis.call('XTRIM', KEYS[4], 'MINID', string.format('%d-%d', ms, seq + 1))
end
if fetching and not taken then
  taken = tonumber(redis.call('GET', KEYS[15]) or '0')
end
if #entries == 0 then
  if #skipped > 0 or #moved > 0 or seal or next_timer then
    return {{}, {}, {}, seal or false, {}, skipped, moved, taken or false, next_timer or false,
      timers_waiting}
  end
  return taken or {}  -- (seven empty parts cost the reply's conversion about a microsecond more)
end
-- cjson refuses a lone UTF-16 surrogate escape ('\ud83d' with no pair), which the workers'
-- JSON decoder takes (and refuses the op that holds it): such an entry is decoded again with
-- each lone surrogate replaced, so that the stored outcomes of its op ids are still looked up
-- (a replay that missed them would run them again and be refused, at every takeover).
local function without_lone_surrogates(text)
  local out, last, i = {}, 1, 1
  local function replace(at)
    out[#out + 1] = string.sub(text, last, at - 1)
    out[#out + 1] = '\\ufffd'
    last = at + 6
  end
  while true do
    local at = string.find(text, '\\', i, true)
    if not at then
      break
    end
    i = at + 2  -- any escape but \u: skipped whole ('\\' included)
    if string.sub(text, at + 1, at + 1) == 'u' then
      local code = tonumber(string.sub(text, at + 2, at + 5), 16) or 0
      i = at + 6
      if code >= 0xD800 and code <= 0xDBFF then
        local low = string.sub(text, at + 6, at + 7) == '\\u'
          and tonumber(string.sub(text, at + 8, at + 11), 16) or 0
        if low >= 0xDC00 and low <= 0xDFFF then
          i = at + 12  -- a pair: kept
        else
          replace(at)
        end
      elseif code >= 0xDC00 and code <= 0xDFFF then
        replace(at)
      end
    end
  end
  out[#out + 1] = string.sub(text, last)
  return table.concat(out)
end
local function decode_ops(text)
  local ok, ops = pcall(cjson.decode, text)
  if not ok then
    ok, ops = pcall(cjson.decode, without_lone_surrogates(text))
  end
  return ok, ops
end
local ids, keys, seen = {}, {}, {}
local careful, cached = ARGV[7] == '1', ARGV[11] == '1'
for _, entry in ipairs(entries) do
  local fields, ops_json, fresh = entry[2], nil, false
  for f = 1, #fields, 2 do
    if fields[f] == 'ops' then
      ops_json = fields[f + 1]
    elseif fields[f] == 'fresh' then
      fresh = fields[f + 1] == '1' and not careful
    end
  end
  -- (Decoding JSON is most of a fetch's cost in Lua: skipped when nothing is to be read.)
  if ops_json and not (fresh and cached) then
    local ok, ops = decode_ops(ops_json)
    if ok and type(ops) == 'table' then
      for _, envelope in ipairs(ops) do
        if type(envelope) == 'table' and type(envelope.id) == 'string' then
          if not fresh then
            ids[#ids + 1] = envelope.id
          end
          local named = envelope.keys
          if type(named) ~= 'table' then
            named = {envelope.key}
          end
          for _, key in ipairs(named) do
            if not cached and type(key) == 'string' and not seen[key] then
              seen[key] = true
              keys[#keys + 1] = key
            end
          end
        end
      end
    end
  end
end
done = stored_outcomes(ids)
for i, state in ipairs(hmget(KEYS[2], keys)) do
  states[#states + 1] = keys[i]
  states[#states + 1] = state or ''
end
if seal == nil then
  seal = redis.call('GET', KEYS[11])
end
return {entries, done, states, seal, redis.call('HGETALL', KEYS[12]), skipped, moved, taken or false,
  next_timer or false, timers_waiting}
