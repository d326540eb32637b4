-- Record a reshard in the namespace's meta hash (field 'move'), unless another one is under way
-- or the layout it leaves is not the live one any more. Only the worker (admin) user may run it.
-- KEYS[1]  the meta hash
-- ARGV[1]  the layout the move leaves, '<generation> <shards>'
-- ARGV[2]  the move record (JSON, see _wire/resharding.py)
-- Returns the move record under way: ARGV[2], recorded now or before; the error
-- "MOVING <record>" when another move is under way; "LIVE <generation> <shards>" when the
-- live layout is another (nothing written either way).
local move = redis.call('HGET', KEYS[1], 'move')
if move then
  if move == ARGV[2] then
    return move
  end
  return redis.error_reply('MOVING ' .. move)
end
local live = (redis.call('HGET', KEYS[1], 'generation') or '0') .. ' '
  .. (redis.call('HGET', KEYS[1], 'shards') or '')
if live ~= ARGV[1] then
  return redis.error_reply('LIVE ' .. live)
end
redis.call('HSET', KEYS[1], 'move', ARGV[2])
return ARGV[2]
