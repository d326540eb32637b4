-- A participant shard grants its keys to a cross-shard op's attempt (fenced: a zombie owner
-- cannot grant). The grant is recorded (for a coordinator that missed the message) and published
-- to the coordinating worker. Called only once every earlier op on those keys has committed, so
-- the states it carries are committed states.
-- The keys are held at the request's place in the stream: a failover that lost the request's
-- entry (the coordinator then appends it again, perhaps behind other requests for the same
-- keys) voids that place, and a grant recorded for it would hold the keys out of the new order.
-- KEYS[1]  epoch      KEYS[2]  results    KEYS[3]  stream
-- ARGV[1]  the owner's epoch   ARGV[2]  grant field ('<op>#<attempt>#g')   ARGV[3]  the grant
-- ARGV[4]  the coordinator's channel ('' with durable_replicas: the owner publishes the grant
--          once replicas have it)
-- ARGV[5]  the id of the request's entry the keys were held for
-- ARGV[6]  the message to publish: the grant, signed for the coordinator's worker when its
--          channel names a key (the coordinator then takes it without reading the record)
-- (A worker granting to an op it coordinates itself hands the grant over in process instead.)
-- Returns 1; error "FENCED ..." if another owner took over; error "GONE ..." if the request's
-- entry is not in the stream (nothing written).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is no longer the owner')
end
if #redis.call('XRANGE', KEYS[3], ARGV[5], ARGV[5]) == 0 then
  return redis.error_reply('GONE entry ' .. ARGV[5] .. ' is not in the stream')
end
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
if ARGV[4] ~= '' then
  publish(KEYS[1], ARGV[4], ARGV[6])
end
return 1
