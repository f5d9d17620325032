-- settle.lua: settle a reservation against actual usage, once per request id (rid).
--
-- KEYS: 1 token bucket, 2 concurrency zset, 3 reservation
-- ARGV: 1 tok_cap_u  2 tok_rate_u  3 actual tokens (whole; -1 = unknown, keep the charge)
--       4 rid  5 '1' when this is the request's release (not an undo): finding no
--         reservation, it leaves {gone = actual} there for GONE_MS, which a forced acquire
--         still on its way (the request was answered ahead of it) charges instead of reserving
-- Refunds reserved-but-unused tokens, or debits overage in full (the level may go below zero:
-- the tenant pays the debt back before its next request; it is not capped, or a tenant could
-- overrun by any amount and pay for one bucket). Deleting the reservation makes a
-- second settle of the same rid a no-op; an expired reservation settles nothing, harmlessly.
-- Returns {1, delta_tokens} (positive = refunded) or {0, 0} when there was nothing to settle.

local now = now_us()
local cap, rate = tonumber(ARGV[1]), tonumber(ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[4])
local reserved = redis.call('HGET', KEYS[3], 'tok')
if not reserved then
  if ARGV[5] == '1' then
    redis.call('HSET', KEYS[3], 'gone', ARGV[3])
    redis.call('PEXPIRE', KEYS[3], 60000)
  end
  return {0, 0}
end
redis.call('DEL', KEYS[3])
local actual = tonumber(ARGV[3])
if actual < 0 then return {1, 0} end
local delta = tonumber(reserved) - actual
if delta == 0 then return {1, 0} end

local l = bucket_level(KEYS[1], cap, rate, now)
bucket_store(KEYS[1], math.min(cap, l + delta * 1000000), cap, rate, now)
return {1, delta}
