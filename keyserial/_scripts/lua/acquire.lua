-- Take a free shard lease, bump the fencing epoch, and judge the previous owner's end.
-- Idempotent for one attempt: sent again with the same attempt id by the worker it granted
-- (the reply was lost), it renews the lease and returns the same grant, with no second epoch
-- and no second strike. (A new attempt by the same worker, after it dropped the shard, gets
-- nothing while its old lease lives: its old runner's calls may still land.)
-- KEYS[1]  lease      KEYS[2]  epoch      KEYS[3]  progress    KEYS[4]  horizon
-- KEYS[5]  suspect    KEYS[6]  stream     KEYS[7]  results     KEYS[8]  results, previous
-- KEYS[9]  dead-letter stream         KEYS[10] when the current results generation began
-- KEYS[11] handover (set by a clean release: the horizon it left)
-- KEYS[12] the last grant, JSON {attempt id, grant}
-- KEYS[13] the epoch of the owner that takes pushed entries (see step.lua): if it is the previous
--          owner's, its inbox is moved into the stream and every entry there counts as fetched
--          by it (any may have been pushed to it and run); dropped here, so that it only ever
--          names the current owner
-- KEYS[14] the shard's inbox      KEYS[15] the inbox's taken count
-- KEYS[16] the shard's seal (a sealed shard's inbox holds strays, never moved in)
-- ARGV[1]  the new owner's token   ARGV[2]  lease TTL (ms)   ARGV[3]  strikes before dead-letter
-- ARGV[4]  the attempt id (unique per attempt, the same when the call is sent again)
-- Returns {milliseconds} when the lease is held by someone else: how long it lives unless renewed
-- (its PTTL: a standby tries again then, not at every round); otherwise
-- {epoch, progress, careful_until, poisoned, results_since, replay_until, suspect}
--   progress       the last entry id whose ops have all committed ('0-0': none yet);
--   careful_until  '' after a clean handover; after a crash, the highest entry id the dead owner
--                  had fetched (its in-flight ops are suspect);
--   poisoned       '' or the id of an op that reached the strike limit: it now has a
--                  PoisonOperation result, is copied to the dead-letter stream and never runs
--                  (its caller hears of it when the new owner's replay answers it from there);
--   results_since  when the current results generation began (ms), '' if none has;
--   replay_until   '' or the highest entry id the previous owner had fetched (after a crash or a
--                  clean handover alike): up to it, the new owner looks up every op's stored
--                  outcome before running it, since some of them may have committed already;
--   suspect        '' or the id of the op that took a strike here (the first op without a
--                  result): the new owner runs it alone, and the rest only once it has committed
--                  (or has run for a lease TTL), so that if it kills this owner too, it is the
--                  first op without a result again and takes the next strike.
-- (parse_id, id_gt and has_outcome come from lib.lua.)

-- The first op fetched but not committed, in stream order. When the owner died with several ops
-- in flight, it may be an innocent slow op rather than the one that killed the owner: running
-- alone under the next owner, it commits, and the next death strikes an op further on. So a
-- poison op is struck once every op ahead of it has committed, and only a death while an op is
-- the first without a result counts against it.
local function finished(field)
  return has_outcome(KEYS[7], KEYS[8], field)
end

local function first_unfinished(after, upto)
  local cursor = after
  while true do
    local entries = xrange_after(KEYS[6], cursor, upto, 100)
    if #entries == 0 then return nil end
    for _, entry in ipairs(entries) do
      local fields = entry[2]
      for i = 1, #fields, 2 do
        if fields[i] == 'ops' then
          local ok, ops = pcall(cjson.decode, fields[i + 1])
          if ok and type(ops) == 'table' then
            for _, envelope in ipairs(ops) do
              -- (An entry of keyserial's grant op, or under an op id holding '#', runs no code:
              -- refused at intake. Never a suspect: struck dead, its poison record would be
              -- stored under a name keyserial keeps for its own records. An op answered without
              -- a stored outcome, as one no worker knew, has a record '<op id>#u' instead: it is
              -- finished too.)
              if type(envelope) == 'table' and type(envelope.id) == 'string'
                  and envelope.op ~= 'keyserial.grant'
                  and not string.find(envelope.id, '#', 1, true)
                  and not finished(envelope.id) and not finished(envelope.id .. '#u') then
                return entry[1], envelope
              end
            end
          end
        end
      end
      cursor = entry[1]
    end
  end
end

-- The envelope as JSON for the dead letter. cjson decodes numbers it cannot encode again (1e400
-- is inf): an error here, after the writes above it, would fail every acquire of the shard.
local function envelope_json(envelope)
  local ok, raw = pcall(cjson.encode, envelope)
  if ok then
    return raw
  end
  return cjson.encode({id = envelope.id, op = tostring(envelope.op),
                       unencodable = 'its arguments hold a number JSON cannot carry (' .. raw .. ')'})
end

local function dead_letter(entry_id, envelope, strikes)
  local outcome = cjson.encode({error = {type = 'keyserial.PoisonOperation',
    message = 'the op was running each of the ' .. strikes .. ' times its worker died;'
      .. ' it was moved to the dead-letter stream and will not run',
    data = {strikes = strikes}}})
  redis.call('HSET', KEYS[7], envelope.id, outcome)
  redis.call('XADD', KEYS[9], 'MAXLEN', '~', 10000, '*', 'entry', entry_id,
    'reason', 'poison: killed its worker ' .. strikes .. ' times', 'raw', envelope_json(envelope))
  -- No reply from here: the new owner's replay finds this stored outcome and replies with it
  -- through its step, like every other reply (with durable_replicas, once replicas have it).
end

if redis.call('GET', KEYS[1]) == ARGV[1] then
  local last = redis.call('GET', KEYS[12])
  if last then
    local granted = cjson.decode(last)
    if granted[1] == ARGV[4] then
      redis.call('PEXPIRE', KEYS[1], ARGV[2])
      return granted[2]
    end
  end
end
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return {redis.call('PTTL', KEYS[1])}
end

local function granted(reply)
  redis.call('SET', KEYS[12], cjson.encode({ARGV[4], reply}))
  return reply
end

local epoch = redis.call('INCR', KEYS[2])
local progress = redis.call('GET', KEYS[3]) or '0-0'
local horizon = redis.call('GET', KEYS[4])
if redis.call('GET', KEYS[13]) == tostring(epoch - 1) then
  horizon = fold_pushes(KEYS[4], KEYS[6], KEYS[14], KEYS[15], KEYS[16])
end
redis.call('DEL', KEYS[13])
local since = redis.call('GET', KEYS[10]) or ''
local handover = redis.call('GET', KEYS[11])
redis.call('DEL', KEYS[11])
if not horizon or not id_gt(horizon, progress) then
  return granted({epoch, progress, '', '', since, '', ''})
end
if handover == horizon then  -- a clean release: nothing to suspect, only outcomes to look up
  return granted({epoch, progress, '', '', since, horizon, ''})
end

local entry_id, envelope = first_unfinished(progress, horizon)
if not entry_id then
  return granted({epoch, progress, horizon, '', since, horizon, ''})
end
local strikes = 1
if redis.call('HGET', KEYS[5], 'op') == envelope.id then
  strikes = tonumber(redis.call('HGET', KEYS[5], 'strikes')) + 1
end
redis.call('HSET', KEYS[5], 'op', envelope.id, 'strikes', strikes)
if strikes >= tonumber(ARGV[3]) then
  dead_letter(entry_id, envelope, strikes)
  return granted({epoch, progress, horizon, envelope.id, since, horizon, ''})
end
return granted({epoch, progress, horizon, '', since, horizon, envelope.id})
