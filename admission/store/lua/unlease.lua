-- unlease.lua: give a lease back and take its KV out of the node's ledger (idempotent).
--
-- KEYS: 1 node leases zset  2 node ledger hash
-- ARGV: 1 ticket
-- Pending prefill is not touched: it drains by time (lease.lua), and a request that ends has
-- either been prefilled already or was never run.
-- Returns {removed (0/1), kv reserved after}.

local removed = redis.call('ZREM', KEYS[1], ARGV[1])
local k = redis.call('HGET', KEYS[2], 'k:' .. ARGV[1])
local kv = tonumber(redis.call('HGET', KEYS[2], 'kv') or '0')
if k then
  kv = math.max(0, kv - tonumber(k))
  redis.call('HDEL', KEYS[2], 'k:' .. ARGV[1])
  redis.call('HSET', KEYS[2], 'kv', kv)
end
return {removed, kv}
