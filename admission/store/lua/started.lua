-- started.lua: a request's first token reached the edge, so the engine has computed its prompt.
-- Engine truth corrects the ledger's guess, which drains pending prefill by time at the
-- measured rate (lease.lua) — a rate that can read far under the node's speed (a quiet node,
-- spans between short prefills): with prefills run in booking order, what is still pending is
-- at most the prefill booked here after this request (pb now less q:<ticket>, the pb counter as
-- it booked). Under vLLM's priority scheduling an earlier booking of a lower class may still be
-- waiting: it is dropped here, as the next urgent request overtakes it in the engine too.
-- Its prefix blocks are computed now: a block lease.lua scored as computed later (when the
-- booked prefill was expected to clear) becomes a hit for the next request at once.
--
-- KEYS: 1 node ledger hash  2 node prefixes zset (lease.lua)
-- ARGV: 1 ticket  2 prefill rate, tokens/s (0: unknown: pending is not drained by time)
-- Returns {1, pending after} or {0, '-1'}: no such booking (released, expired, started already).

local now = now_us()
local ledger, ticket = KEYS[1], ARGV[1]
local f = redis.call('HMGET', ledger, 'q:' .. ticket, 'p', 't', 'pb', 'b:' .. ticket)
if not f[1] then return {0, '-1'} end
redis.call('HDEL', ledger, 'q:' .. ticket)
local rate = tonumber(ARGV[2])
local pending = tonumber(f[2] or '0')
if f[3] and rate > 0 then
  pending = math.max(0, pending - rate * (now - tonumber(f[3])) / 1000000)
end
local after = math.max(0, tonumber(f[4] or '0') - tonumber(f[1]))
if after < pending then
  pending = after
  redis.call('HSET', ledger, 'p', tostring(pending), 't', now)
end
if f[5] then
  local blocks, size = {}, nil
  for w in string.gmatch(f[5], '%S+') do
    if size == nil then size = w else blocks[#blocks + 1] = w end
  end
  if #blocks > 0 then
    local seen = redis.call('ZMSCORE', KEYS[2], unpack(blocks))
    local scores = {}
    for i, b in ipairs(blocks) do
      if seen[i] and tonumber(seen[i]) > now then
        scores[#scores + 1] = now - i  -- the tail least recently used, as lease.lua scores
        scores[#scores + 1] = b
      end
    end
    if #scores > 0 then redis.call('ZADD', KEYS[2], 'XX', unpack(scores)) end
  end
end
return {1, tostring(pending)}
