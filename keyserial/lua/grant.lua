-- A participant shard grants its keys to a cross-shard op's attempt (fenced: a zombie owner
-- cannot grant). The grant is recorded (for a coordinator that missed the message) and published
-- to the coordinating worker. Called only once every earlier op on those keys has committed, so
-- the states it carries are committed states.
-- KEYS[1]  epoch      KEYS[2]  results
-- ARGV[1]  the owner's epoch   ARGV[2]  grant field ('<op>#<attempt>#g')   ARGV[3]  the grant
-- ARGV[4]  the coordinator's channel ('' with durable_replicas: the owner publishes the grant
--          once replicas have it)
-- (A worker granting to an op it coordinates itself hands the grant over in process instead.)
-- Returns 1; error "FENCED ..." if another owner took over.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] ~= '' then
  redis.call('PUBLISH', ARGV[4], ARGV[3])
end
return 1
