-- acquire.lua: check and debit all of one tenant's limits atomically (all-or-nothing).
--
-- KEYS: 1 request bucket, 2 token bucket, 3 burst zset, 4 concurrency zset, 5 reservation
-- ARGV: 1 req_cap_u  2 req_rate_u  3 req_cost_u
--       4 tok_cap_u  5 tok_rate_u  6 tok_cost_u
--       7 burst_window_us  8 burst_max (0 = off)
--       9 max_concurrent (0 = off)  10 lease_ttl_us  11 ticket  12 tok_cost (whole tokens)
-- Units: *_u are micro-units (1e-6 request or token), rates are micro-units per second.
-- Bucket helpers and time: prelude.lua.
-- Returns {1, req_level_u, tok_level_u} or {0, reason, retry_after_ms, capacity_u}.

local function wait_ms(deficit, rate)
  return math.ceil(deficit * 1000 / rate)
end

local now = now_us()
local req_cap, req_rate, req_cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_cap, tok_rate, tok_cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local window, burst_max = tonumber(ARGV[7]), tonumber(ARGV[8])
local max_cc, lease_ttl, ticket = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]

-- The same request asked again (its first sidecar died while it waited in the queue, and the
-- edge re-asked another with the same request id): it is charged already. Keep what it holds
-- alive instead of charging it twice; its one release settles it.
if redis.call('EXISTS', KEYS[5]) == 1 then
  local lease_ms = math.ceil(lease_ttl / 1000)
  redis.call('PEXPIRE', KEYS[5], lease_ms)
  if max_cc > 0 and redis.call('ZSCORE', KEYS[4], ticket) then
    redis.call('ZADD', KEYS[4], now + lease_ttl, ticket)
    redis.call('PEXPIRE', KEYS[4], lease_ms)
  end
  return {1, -1, -1}
end

if tok_cost > tok_cap then return {0, 'tokens_exceed_capacity', 0, tok_cap} end
if req_cost > req_cap then return {0, 'requests_exceed_capacity', 0, req_cap} end

local rq = bucket_level(KEYS[1], req_cap, req_rate, now)
if rq < req_cost then
  return {0, 'requests_per_s', wait_ms(req_cost - rq, req_rate), req_cap}
end
local tk = bucket_level(KEYS[2], tok_cap, tok_rate, now)
if tk < tok_cost then
  return {0, 'tokens_per_min', wait_ms(tok_cost - tk, tok_rate), tok_cap}
end
if burst_max > 0 then
  local n = redis.call('ZCOUNT', KEYS[3], '(' .. (now - window), '+inf')
  if n >= burst_max then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. (now - window), '+inf',
                              'WITHSCORES', 'LIMIT', 0, 1)
    return {0, 'burst', math.ceil((tonumber(oldest[2]) + window - now) / 1000), burst_max}
  end
end
if max_cc > 0 then
  if redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf') >= max_cc then
    local first = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. now, '+inf',
                             'WITHSCORES', 'LIMIT', 0, 1)
    -- A concurrency slot frees when a request ends; the oldest lease's expiry is an upper bound.
    return {0, 'concurrency', math.min(1000, math.ceil((tonumber(first[2]) - now) / 1000)), max_cc}
  end
end

-- Every check passed: write everything.
bucket_store(KEYS[1], rq - req_cost, req_cap, req_rate, now)
bucket_store(KEYS[2], tk - tok_cost, tok_cap, tok_rate, now)
local lease_ms = math.ceil(lease_ttl / 1000)
if burst_max > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
  redis.call('ZADD', KEYS[3], now, ticket)
  redis.call('PEXPIRE', KEYS[3], math.ceil(window / 1000) + 1)
end
if max_cc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('ZADD', KEYS[4], now + lease_ttl, ticket)
  redis.call('PEXPIRE', KEYS[4], lease_ms)
end
redis.call('HSET', KEYS[5], 'tok', ARGV[12])
redis.call('PEXPIRE', KEYS[5], lease_ms)
return {1, rq - req_cost, tk - tok_cost}
