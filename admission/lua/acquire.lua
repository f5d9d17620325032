-- acquire.lua: check and debit all of one tenant's limits atomically (all-or-nothing).
--
-- KEYS: 1 request bucket, 2 token bucket, 3 burst zset, 4 concurrency zset, 5 reservation
-- ARGV: 1 req_cap_u  2 req_rate_u  3 req_cost_u
--       4 tok_cap_u  5 tok_rate_u  6 tok_cost_u
--       7 burst_window_us  8 burst_max (0 = off)
--       9 max_concurrent (0 = off)  10 lease_ttl_us  11 ticket  12 tok_cost (whole tokens)
-- Units: *_u are micro-units (1e-6 request or token), rates are micro-units per second.
-- Time is Redis TIME (µs), never the caller's clock. Buckets are hashes {l = level, t = time};
-- a missing bucket is a full one, and each key expires exactly when it would be full again.
-- Returns {1, req_level_u, tok_level_u} or {0, reason, retry_after_ms, capacity_u}.

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Level of a bucket at `now`, refilled since its last write and clamped to `cap`
-- (a capacity lowered by a policy reload clamps here).
local function level(key, cap, rate, now)
  local v = redis.call('HMGET', key, 'l', 't')
  if not v[1] then return cap end
  local l, t = tonumber(v[1]), tonumber(v[2])
  local elapsed = now - t
  if elapsed <= 0 then return math.min(l, cap) end
  if l >= cap then return cap end
  local fill_us = math.ceil((cap - l) * 1000000 / rate)
  if elapsed >= fill_us then return cap end
  return math.min(cap, l + math.floor(elapsed * rate / 1000000))
end

local function wait_ms(deficit, rate)
  return math.ceil(deficit * 1000 / rate)
end

local function store(key, l, cap, rate, now)
  redis.call('HSET', key, 'l', l, 't', now)
  local full_ms = math.ceil((cap - l) * 1000 / rate)
  redis.call('PEXPIRE', key, math.max(1, full_ms))
end

local now = now_us()
local req_cap, req_rate, req_cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_cap, tok_rate, tok_cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local window, burst_max = tonumber(ARGV[7]), tonumber(ARGV[8])
local max_cc, lease_ttl, ticket = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]

if tok_cost > tok_cap then return {0, 'tokens_exceed_capacity', 0, tok_cap} end
if req_cost > req_cap then return {0, 'requests_exceed_capacity', 0, req_cap} end

local rq = level(KEYS[1], req_cap, req_rate, now)
if rq < req_cost then
  return {0, 'requests_per_s', wait_ms(req_cost - rq, req_rate), req_cap}
end
local tk = level(KEYS[2], tok_cap, tok_rate, now)
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
store(KEYS[1], rq - req_cost, req_cap, req_rate, now)
store(KEYS[2], tk - tok_cost, tok_cap, tok_rate, now)
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
