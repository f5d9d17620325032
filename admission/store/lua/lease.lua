-- lease.lua: take one in-flight lease on a node if it is under its cap (atomic across sidecars).
--
-- KEYS: 1 node leases zset (ticket → expiry µs)
-- ARGV: 1 max_inflight  2 lease_ttl_us  3 ticket
-- Expired leases (a lost release) are dropped first: a crash leaks a slot for one TTL at most.
-- Returns {1, in_flight_after} or {0, in_flight}.

local now = now_us()
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[1]) then return {0, n} end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('PEXPIRE', KEYS[1], math.ceil(tonumber(ARGV[2]) / 1000))
return {1, n + 1}
