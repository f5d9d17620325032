-- unlease.lua: give a lease back and take its KV out of the node's ledger (idempotent).
--
-- KEYS: 1 node leases zset  2 node ledger hash  3 released-first zset (ticket → expiry µs)
--       4 node prefixes zset (lease.lua): the ticket's prefix blocks are let go
-- ARGV: 1 ticket  2 '1' (or '3': it never reached its engine, the node unreachable; or '4': it
--       ran, and the engine found none of the prefix it was booked as holding) when this
--       is the request's release (not the undo of a lease that may
--       not have been taken): finding no lease — or releasing one answered ahead —, it leaves
--       a mark for GONE_US, so that a forced booking still on its way, or asked again, books
--       nothing; '2' when the request will never run on this ticket (refused, timed out or
--       gone after its lease was granted): the mark is left whatever was found, so that a
--       copy of the lease's round trip that Redis runs late books nothing either
-- Pending prefill is not touched: it drains by time (lease.lua), and a request that ends has
-- either been prefilled already or was never run. The urgent reserve is not touched either:
-- it remembers realtime's recent peak and decays by time (lease.lua).
-- Returns {removed (0/1), kv reserved after}.

local GONE_US = 60000000
local now = now_us()
local removed = redis.call('ZREM', KEYS[1], ARGV[1])
-- A ticket answered ahead (':a') is marked even when its lease was found: its forced booking
-- may be asked again after this (a round trip the sidecar's late loop timed out, retried), and
-- must then book nothing (9 leases left after 1,024 clients on a loaded machine, until TTL).
local released = ARGV[2] == '1' or ARGV[2] == '3' or ARGV[2] == '4'
if ARGV[2] == '2' or (released and (removed == 0 or string.sub(ARGV[1], -2) == ':a')) then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  redis.call('ZADD', KEYS[3], now + GONE_US, ARGV[1])
  redis.call('PEXPIRE', KEYS[3], GONE_US / 1000)
end
-- Only a request's release that reached its engine ('1') may have run: the blocks its lease
-- brought were computed (kept resident); otherwise they leave the node (prelude: prefix_unhold).
local ran = ARGV[2] == '1' or (ARGV[2] == '4' and 'unconfirmed')
local freed = prefix_unhold(KEYS[2], KEYS[4], ARGV[1], now, ran)
local k = tonumber(redis.call('HGET', KEYS[2], 'k:' .. ARGV[1]) or '0')
local f = redis.call('HMGET', KEYS[2], 'kv', 'u', 's')
local kv = tonumber(f[1] or '0')
if freed > 0 then
  kv = math.max(0, kv - freed)
  redis.call('HSET', KEYS[2], 'kv', kv, 's', math.max(0, tonumber(f[3] or '0') - freed))
end
if k ~= 0 then
  kv = math.max(0, kv - math.abs(k))
  redis.call('HDEL', KEYS[2], 'k:' .. ARGV[1])
  redis.call('HSET', KEYS[2], 'kv', kv)
  if k < 0 then redis.call('HSET', KEYS[2], 'u', math.max(0, tonumber(f[2] or '0') + k)) end
end
return {removed, kv}
