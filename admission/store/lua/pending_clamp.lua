-- pending_clamp.lua: engine truth for a node's pending prefill (run by the node agent).
-- KEYS: 1 the node's ledger. ARGV: 1 prefill rate, tokens/s  2 cap, tokens
-- The engine had nothing waiting when sampled: no prompt waits for its prefill there but those
-- on their way (booked since) and the rest of prefills already running. The ledger's pending
-- prefill, drained at the measured rate, is cut to the cap: below saturation that rate reads
-- what the node was given, the drain then matches the bookings only on average, and the figure
-- drifts up like a random walk (on 144 short chats in flight, 19,000 tokens "pending" after
-- 15 s on a node with nothing waiting, until the prefill budget refused realtime there).
-- Returns 1 if it cut, 0 if not.
local v = redis.call('HMGET', KEYS[1], 'p', 't')
if not v[1] then return 0 end
local now = now_us()
local rate, cap = tonumber(ARGV[1]), tonumber(ARGV[2])
local p = tonumber(v[1])
if v[2] and rate > 0 then p = math.max(0, p - rate * (now - tonumber(v[2])) / 1000000) end
if p <= cap then return 0 end
redis.call('HSET', KEYS[1], 'p', tostring(cap), 't', now)
return 1
