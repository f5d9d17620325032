-- lease.lua: take one in-flight lease on a node, and book it in the node's ledger, atomically
-- across sidecars: every sidecar sees one view of what each node will really hold.
--
-- KEYS: 1 node leases zset (ticket → expiry µs)  2 node ledger hash
--       3 released-first zset (unlease.lua): a booking of a ticket found there books nothing
--         (the request ended before its booking arrived: a forced one, or one whose reply the
--         sidecar timed out on and admitted the request without, that Redis ran after all)
--       4 node prefixes zset: prefix blocks resident on the node (hash → µs last used)
-- ARGV: 1 max_inflight  2 lease_ttl_us  3 ticket
--       4 prompt tokens (pending prefill this request adds)
--       5 KV tokens reserved (prompt estimate + output cap)
--       6 prefill rate, tokens/s (0: unknown; pending prefill is then not drained by time)
--       7 prefill budget, tokens (0: not gated by pending prefill); while the urgent class
--         has KV booked on the node (u > 0) a lower class's room is 0 instead: it gets only
--         idle prefill there (pending cleared)
--       8 KV limit, tokens (-1: not gated by memory): reserved KV after this one must stay below
--         (for an urgent ask, the urgent class's own KV after this one)
--       9 urgent: 1 for the class admitted until drain (its KV counts toward the reserve)
--      10 reserve limit, tokens (-1: none): for other classes, their KV + this one + the urgent
--         reserve must stay below it (the drain watermark in tokens)
--      11 urgent KV the caller has waiting for this node (its share of its queue)
--      12 force: '1' = the sidecar already sent the request here (it answered ahead of this
--         round trip, its last view showing ample room): book it whatever the limits say now,
--         so that the ledger holds what the node really runs
--      13 tokens per prefix block (0: no prefix)
--      14 resident blocks the node's KV pool holds (0: unbounded): past it, blocks nobody
--         holds are evicted, least recently used first, as the engine evicts them
--      15… the prompt's prefix blocks, in order (chained hashes from the edge: each names the
--         whole prompt head up to its end)
-- Prefix: the leading blocks resident on the node are computed already: the request's
-- pending prefill leaves them out. Its blocks are booked in kv once per node, by the first
-- lease that holds them (reference counts h:<hash>); the lease's own entry (k:<ticket>) is the
-- rest of its KV. Resident blocks nobody holds cost nothing, as in vLLM's kv_cache_usage.
-- Ledger fields: p = pending prefill tokens (drained at the prefill rate since t), t = µs,
--   kv = KV tokens reserved by live leases, u = the urgent class's share of kv,
--   r = the urgent reserve (its recent peak: u, or u + what waits, halving every RESERVE_HALF_US
--   since rt), k:<ticket> = this lease's KV tokens (negative: an urgent lease), s = the part of
--   kv that is shared prefix blocks held (booked once, whoever holds them), pb = pending
--   prefill booked in all (a counter the agent reads).
-- The reserve keeps room for what realtime has recently needed on this node, however small the
-- band between the watermarks is in requests (a tiny KV pool): lower classes stay below
-- drain − reserve, so realtime is not held behind work vLLM would have to preempt for it.
-- Expired leases (a lost release) are dropped first, with their KV: a crash leaks for one TTL.
-- A node whose pending prefill has drained always takes one request, whatever its size: the
-- budget cannot starve a long prompt, and the node's prefill rate gets measured at full speed.
-- Returns {1, in_flight, pending, kv, over, hit} or {0, in_flight, reason, pending, kv, hit};
-- over: the rule a forced booking went past, '' if none, or 'released' (nothing booked, see
-- KEYS[3]); hit: how many of the prefix blocks were resident.

local RESERVE_HALF_US = 20000000
local now = now_us()
local leases, ledger, resident, ticket = KEYS[1], KEYS[2], KEYS[4], ARGV[3]
local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', now)
local f = redis.call('HMGET', ledger, 'kv', 'u', 'r', 'rt', 's')
local kv, u, shared = tonumber(f[1] or '0'), tonumber(f[2] or '0'), tonumber(f[5] or '0')
local reserve = tonumber(f[3] or '0')
if f[4] then reserve = reserve * 0.5 ^ ((now - tonumber(f[4])) / RESERVE_HALF_US) end
for _, t in ipairs(expired) do
  redis.call('ZREM', leases, t)
  local freed = prefix_unhold(ledger, resident, t, now, true)  -- lost release: it may have run
  kv, shared = kv - freed, shared - freed
  local k = tonumber(redis.call('HGET', ledger, 'k:' .. t) or '0')
  if k ~= 0 then
    kv = kv - math.abs(k)
    if k < 0 then u = u + k end
    redis.call('HDEL', ledger, 'k:' .. t)
  end
end
kv, u, shared = math.max(0, kv), math.max(0, u), math.max(0, shared)
local n = redis.call('ZCARD', leases)
-- The same ticket again (a retry after a round trip that may have run) replaces its booking:
-- checked and booked as if it were not there yet (refused, it is left with none).
-- Its prefix blocks are let go first (taken again if granted).
local freed = prefix_unhold(ledger, resident, ticket, now, false)
kv, shared = math.max(0, kv - freed), math.max(0, shared - freed)
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
-- No lease left here: nothing is pending, whatever the measured rate says (it can read far
-- under the node's speed — once a few tokens per second after short chats one at a time —,
-- which kept an idle node "busy" and answered realtime 429 slo_unreachable).
if n == 0 then pending = 0 end
local prompt, need = tonumber(ARGV[4]), tonumber(ARGV[5])
local size, blocks = tonumber(ARGV[13] or '0'), {}
for i = 15, #ARGV do blocks[#blocks + 1] = ARGV[i] end
local hit, fresh, refs, seen = 0, 0, {}, {}
if size > 0 and #blocks > 0 then
  -- A resident block's score is when it is (or will be) computed. The hit is the leading run
  -- computed by now or held by a live lease that computes it: vLLM V1 caches a block when it
  -- schedules its chunk, and a request queued behind the one computing a head starts once
  -- that head's last chunk is scheduled, sharing all of it (tests/test_vllm.py, four copies
  -- of a new prompt sent at once on a real node: one computed). Its prefill is booked once,
  -- by the lease that brought it, and its KV once, as shared.
  seen = redis.call('ZMSCORE', resident, unpack(blocks))
  local hkeys = {}
  for i, b in ipairs(blocks) do hkeys[i] = 'h:' .. b end
  refs = redis.call('HMGET', ledger, unpack(hkeys))
  while hit < #blocks and seen[hit + 1]
      and (tonumber(seen[hit + 1]) <= now or refs[hit + 1]) do
    hit = hit + 1
  end
  for i = 1, #blocks do
    if not refs[i] then fresh = fresh + size end  -- held by nobody yet: booked once, as shared
  end
  prompt = math.max(0, prompt - hit * size)
  need = math.max(0, need - #blocks * size)  -- the lease's own: the rest of its prompt, output
end
local reason = nil
if n >= tonumber(ARGV[1]) then
  reason = 'inflight'
elseif budget > 0 and pending > 0
    and pending + prompt > ((u_others > 0 and not urgent) and 0 or budget) then
  -- While the urgent class has KV booked here, lower classes get only idle prefill.
  reason = 'prefill'
elseif kv_limit >= 0 and (urgent and u_others + shared or kv_others) + need + fresh > kv_limit then
  -- The urgent class counts only its own KV and the shared prefix blocks (which it may hold:
  -- not preemptible for it): vLLM preempts lower classes to make it room.
  reason = 'memory'
elseif not urgent and reserve_limit >= 0
    and kv_others - u_others + need + fresh + math.max(u_others, reserve) > reserve_limit then
  reason = 'reserve'
end
local over = ''
if KEYS[3] and redis.call('ZSCORE', KEYS[3], ticket) then
  -- The mark stays until it expires (unlease.lua trims): the same booking asked again (its
  -- reply timed out by a late loop) must find it too.
  redis.call('HSET', ledger, 'kv', kv, 'u', u, 's', shared)  -- expired leases dropped above
  return {1, n, tostring(pending), kv, 'released', 0}
end
if ARGV[12] == '1' and reason then
  over, reason = reason, nil
end
if reason then
  -- Refused: an earlier booking of this ticket goes. It is a retry's first copy (a round trip
  -- the sidecar's late loop timed out on, which ran after all) or a dead sidecar's (the request
  -- asked again): the caller now holds nothing, so nothing would release it (46 leases left
  -- until their TTL after 6,000 clients, tests/test_overload.py). Its share of r stays.
  reserve = math.max(reserve, u)
  if redis.call('ZREM', leases, ticket) == 1 or again ~= 0 then
    redis.call('HDEL', ledger, 'k:' .. ticket)
    kv, u = kv_others, u_others
  end
  redis.call('HSET', ledger, 'p', tostring(pending), 't', now, 'kv', kv, 'u', u,
             'r', tostring(reserve), 'rt', now, 's', shared)
  return {0, n, reason, tostring(pending), kv, hit}
end
redis.call('ZADD', leases, now + tonumber(ARGV[2]), ticket)
if rate > 0 then pending = pending + prompt end
kv, u, shared = kv_others + need + fresh, u_others, shared + fresh
local booked = need
if urgent then
  u = u + need
  booked = -need
  reserve = math.max(reserve, u)
end
redis.call('HSET', ledger, 'p', tostring(pending), 't', now, 'kv', kv, 'u', u,
           'r', tostring(reserve), 'rt', now, 'k:' .. ticket, booked, 's', shared)
-- pb: prefill booked in all, never decremented: the agent compares it with what the engine
-- computed (admission/nodes/rates.py, Booking), to drain p at the rate the node clears it.
if prompt > 0 then redis.call('HINCRBY', ledger, 'pb', math.floor(prompt)) end
local ttl_ms = math.ceil(tonumber(ARGV[2]) / 1000)
if #blocks > 0 then
  local counts, scores, named = {}, {}, {}
  for i, b in ipairs(blocks) do
    named[i] = (refs[i] or seen[i]) and b or '+' .. b  -- '+': brought here (prelude)
    counts[#counts + 1] = 'h:' .. b
    counts[#counts + 1] = tonumber(refs[i] or '0') + 1
    if i <= hit and tonumber(seen[i]) > now then
      scores[#scores + 1] = tonumber(seen[i])  -- held and still being computed: stays so
    elseif i <= hit then
      scores[#scores + 1] = now - i  -- the tail least recently used (prelude: prefix_unhold)
    else  -- computed once this node's prefill booked so far (this one's included) has cleared
      local wait_us = rate > 0 and math.floor(pending / rate * 1000000) or 0
      local at = now + wait_us - i
      if seen[i] then at = math.min(at, math.max(now - i, tonumber(seen[i]))) end
      scores[#scores + 1] = at
    end
    scores[#scores + 1] = b
  end
  redis.call('HSET', ledger, 'b:' .. ticket, size .. ' ' .. table.concat(named, ' '),
             unpack(counts))
  redis.call('ZADD', resident, unpack(scores))
  -- The engine keeps unheld blocks only in the part of its pool that running requests leave
  -- free: resident blocks ≤ pool − what the leases hold as their own (booked output caps
  -- included, so this evicts early rather than late: a hit is under-, not over-estimated).
  local cap = tonumber(ARGV[14] or '0')
  if cap > 0 then cap = math.max(#blocks, cap - math.ceil((kv - shared) / size)) end
  local extra = cap > 0 and redis.call('ZCARD', resident) - cap or 0
  if extra > 0 then
    -- Evict what nobody holds, least recently used first (held blocks cannot be evicted).
    for _, b in ipairs(redis.call('ZRANGE', resident, 0, extra + #blocks)) do
      if extra <= 0 then break end
      if redis.call('HEXISTS', ledger, 'h:' .. b) == 0 then
        redis.call('ZREM', resident, b)
        extra = extra - 1
      end
    end
  end
  redis.call('PEXPIRE', resident, ttl_ms)
end
redis.call('PEXPIRE', leases, ttl_ms)
redis.call('PEXPIRE', ledger, ttl_ms)
return {1, n + 1, tostring(pending), kv, over, hit}
