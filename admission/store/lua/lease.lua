-- lease.lua: take one in-flight lease on a node, and book it in the node's ledger, atomically
-- across sidecars: every sidecar sees one view of what each node will really hold.
--
-- KEYS: 1 node leases zset (ticket → expiry µs)  2 node ledger hash
--       3 released-first zset (unlease.lua): a forced booking of a ticket found there books
--         nothing (the request ended before its booking arrived)
-- ARGV: 1 max_inflight  2 lease_ttl_us  3 ticket
--       4 prompt tokens (pending prefill this request adds)
--       5 KV tokens reserved (prompt estimate + output cap)
--       6 prefill rate, tokens/s (0: unknown; pending prefill is then not drained by time)
--       7 prefill budget, tokens (0: this class is not gated by pending prefill); while the
--         urgent class has KV booked on the node (u > 0) the room is 0 instead: a lower class
--         gets only idle prefill there (pending cleared)
--       8 KV limit, tokens (-1: not gated by memory): reserved KV after this one must stay below
--         (for an urgent ask, the urgent class's own KV after this one)
--       9 urgent: 1 for the class admitted until drain (its KV counts toward the reserve)
--      10 reserve limit, tokens (-1: none): for other classes, their KV + this one + the urgent
--         reserve must stay below it (the drain watermark in tokens)
--      11 urgent KV the caller has waiting for this node (its share of its queue)
--      12 force: '1' = the sidecar already sent the request here (it answered ahead of this
--         round trip, its last view showing ample room): book it whatever the limits say now,
--         so that the ledger holds what the node really runs
-- Ledger fields: p = pending prefill tokens (drained at the prefill rate since t), t = µs,
--   kv = KV tokens reserved by live leases, u = the urgent class's share of kv,
--   r = the urgent reserve (its recent peak: u, or u + what waits, halving every RESERVE_HALF_US
--   since rt), k:<ticket> = this lease's KV tokens (negative: an urgent lease).
-- The reserve keeps room for what realtime has recently needed on this node, however small the
-- band between the watermarks is in requests (a tiny KV pool): lower classes stay below
-- drain − reserve, so realtime is not held behind work vLLM would have to preempt for it.
-- Expired leases (a lost release) are dropped first, with their KV: a crash leaks for one TTL.
-- A node whose pending prefill has drained always takes one request, whatever its size: the
-- budget cannot starve a long prompt, and the node's prefill rate gets measured at full speed.
-- Returns {1, in_flight, pending, kv, over} or {0, in_flight, reason, pending, kv}; over: the
-- rule a forced booking went past, '' if none, or 'released' (nothing booked, see KEYS[3]).

local RESERVE_HALF_US = 20000000
local now = now_us()
local leases, ledger, ticket = KEYS[1], KEYS[2], ARGV[3]
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
local f = redis.call('HMGET', ledger, 'kv', 'u', 'r', 'rt')
local kv, u = tonumber(f[1] or '0'), tonumber(f[2] or '0')
local reserve = tonumber(f[3] or '0')
if f[4] then reserve = reserve * 0.5 ^ ((now - tonumber(f[4])) / RESERVE_HALF_US) end
for _, t in ipairs(expired) do
  redis.call('ZREM', leases, t)
  local k = tonumber(redis.call('HGET', ledger, 'k:' .. t) or '0')
  if k ~= 0 then
    kv = kv - math.abs(k)
    if k < 0 then u = u + k end
    redis.call('HDEL', ledger, 'k:' .. t)
  end
end
kv, u = math.max(0, kv), math.max(0, u)
local n = redis.call('ZCARD', leases)
-- The same ticket again (a retry after a round trip that may have run) replaces its booking:
-- checked and booked as if it were not there yet.
local again = tonumber(redis.call('HGET', ledger, 'k:' .. ticket) or '0')
local kv_others = math.max(0, kv - math.abs(again))
local u_others = u
if again < 0 then u_others = math.max(0, u + again) end
if redis.call('ZSCORE', leases, ticket) then n = n - 1 end
local rate, budget, kv_limit = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local urgent, reserve_limit = ARGV[9] == '1', tonumber(ARGV[10] or '-1')
reserve = math.max(reserve, u_others + tonumber(ARGV[11] or '0'))
local v = redis.call('HMGET', ledger, 'p', 't')
local pending = tonumber(v[1] or '0')
if v[2] and rate > 0 then
  pending = math.max(0, pending - rate * (now - tonumber(v[2])) / 1000000)
end
local prompt, need = tonumber(ARGV[4]), tonumber(ARGV[5])
local reason = nil
if n >= tonumber(ARGV[1]) then
  reason = 'inflight'
elseif budget > 0 and pending > 0 and pending + prompt > (u_others > 0 and 0 or budget) then
  -- While the urgent class has KV booked here, lower classes get only idle prefill.
  reason = 'prefill'
elseif kv_limit >= 0 and (urgent and u_others or kv_others) + need > kv_limit then
  -- The urgent class counts only its own KV: vLLM preempts lower classes to make it room.
  reason = 'memory'
elseif not urgent and reserve_limit >= 0
    and kv_others - u_others + need + math.max(u_others, reserve) > reserve_limit then
  reason = 'reserve'
end
local over = ''
if ARGV[12] == '1' then
  if redis.call('ZSCORE', KEYS[3], ticket) then
    redis.call('ZREM', KEYS[3], ticket)
    redis.call('HSET', ledger, 'kv', kv, 'u', u)  -- expired leases were dropped above
    return {1, n, tostring(pending), kv, 'released'}
  end
  if reason then
    over, reason = reason, nil
  end
end
if reason then
  -- Refused, the ticket's earlier urgent booking (a retry) stays: so does its share of r.
  reserve = math.max(reserve, u)
  redis.call('HSET', ledger, 'p', tostring(pending), 't', now, 'kv', kv, 'u', u,
             'r', tostring(reserve), 'rt', now)
  return {0, n, reason, tostring(pending), kv}
end
redis.call('ZADD', leases, now + tonumber(ARGV[2]), ticket)
if rate > 0 then pending = pending + prompt end
kv, u = kv_others + need, u_others
local booked = need
if urgent then
  u = u + need
  booked = -need
  reserve = math.max(reserve, u)
end
redis.call('HSET', ledger, 'p', tostring(pending), 't', now, 'kv', kv, 'u', u,
           'r', tostring(reserve), 'rt', now, 'k:' .. ticket, booked)
local ttl_ms = math.ceil(tonumber(ARGV[2]) / 1000)
redis.call('PEXPIRE', leases, ttl_ms)
redis.call('PEXPIRE', ledger, ttl_ms)
return {1, n + 1, tostring(pending), kv, over}
