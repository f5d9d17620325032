-- acquire.lua: check and debit all of one tenant's limits atomically (all-or-nothing).
--
-- KEYS: 1 request bucket, 2 token bucket, 3 burst zset, 4 concurrency zset, 5 reservation
-- ARGV: 1 req_cap_u  2 req_rate_u  3 req_cost_u
--       4 tok_cap_u  5 tok_rate_u  6 tok_cost_u
--       7 burst_window_us  8 burst_max (0 = off)
--       9 max_concurrent (0 = off)  10 lease_ttl_us  11 rid  12 tok_cost (whole tokens)
--      13 force: '1' = the sidecar already let this request through (it answered ahead of this
--         round trip, its last figures showing room): debit it whatever the limits say now
--         (levels may go below zero: a debt paid back before the next request)
-- Units: *_u are micro-units (1e-6 request or token), rates are micro-units per second.
-- Bucket helpers and time: prelude.lua.
-- Returns {1, req_level_u, tok_level_u, concurrent, in_burst_window, over} (after this debit;
-- counts are 0 for a limit that is off; over = the limit a forced debit went past, or '') or
-- {0, reason, retry_after_ms, capacity_u}.

local function wait_ms(deficit, rate)
  return math.ceil(deficit * 1000 / rate)
end

local now = now_us()
local req_cap, req_rate, req_cost = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local tok_cap, tok_rate, tok_cost = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local window, burst_max = tonumber(ARGV[7]), tonumber(ARGV[8])
local max_cc, lease_ttl, rid = tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11]

local force = ARGV[13] == '1'
local gone = redis.call('HGET', KEYS[5], 'gone')
if gone then
  redis.call('DEL', KEYS[5])
  if force then
    -- Released before this booking arrived (settle.lua left what it used): charge that, hold
    -- nothing. Not forced, the mark is stale (a request id seen again): decide as new.
    local used = tonumber(gone)
    if used < 0 then used = tonumber(ARGV[12]) end
    local rq = bucket_level(KEYS[1], req_cap, req_rate, now)
    local tk = bucket_level(KEYS[2], tok_cap, tok_rate, now)
    bucket_store(KEYS[1], rq - req_cost, req_cap, req_rate, now)
    bucket_store(KEYS[2], tk - used * 1000000, tok_cap, tok_rate, now)
    return {1, -1, -1}
  end
end

-- The same request asked again (its first sidecar died while it waited in the queue, and the
-- edge re-asked another with the same request id): it is charged already. Keep what it holds
-- alive instead of charging it twice; its one release settles it.
if redis.call('EXISTS', KEYS[5]) == 1 then
  local lease_ms = math.ceil(lease_ttl / 1000)
  redis.call('PEXPIRE', KEYS[5], lease_ms)
  if max_cc > 0 and redis.call('ZSCORE', KEYS[4], rid) then
    redis.call('ZADD', KEYS[4], now + lease_ttl, rid)
    redis.call('PEXPIRE', KEYS[4], lease_ms)
  end
  return {1, -1, -1}
end

-- The first limit that says no: {reason, retry_after_ms, capacity_u}. Unless the debit is
-- forced, that is the answer; forced, it is only named (`over` below).
local deny = nil
if tok_cost > tok_cap then
  deny = {'tokens_exceed_capacity', 0, tok_cap}
elseif req_cost > req_cap then
  deny = {'requests_exceed_capacity', 0, req_cap}
end
local rq = bucket_level(KEYS[1], req_cap, req_rate, now)
local tk = bucket_level(KEYS[2], tok_cap, tok_rate, now)
if not deny and rq < req_cost then
  deny = {'requests_per_s', wait_ms(req_cost - rq, req_rate), req_cap}
end
if not deny and tk < tok_cost then
  deny = {'tokens_per_min', wait_ms(tok_cost - tk, tok_rate), tok_cap}
end
local in_window = 0
if burst_max > 0 then
  in_window = redis.call('ZCOUNT', KEYS[3], '(' .. (now - window), '+inf')
  if not deny and in_window >= burst_max then
    local oldest = redis.call('ZRANGEBYSCORE', KEYS[3], '(' .. (now - window), '+inf',
                              'WITHSCORES', 'LIMIT', 0, 1)
    deny = {'burst', math.ceil((tonumber(oldest[2]) + window - now) / 1000), burst_max}
  end
end
local running = 0
if max_cc > 0 then
  running = redis.call('ZCOUNT', KEYS[4], '(' .. now, '+inf')
  if not deny and running >= max_cc then
    local first = redis.call('ZRANGEBYSCORE', KEYS[4], '(' .. now, '+inf',
                             'WITHSCORES', 'LIMIT', 0, 1)
    -- A concurrency slot frees when a request ends; the oldest lease's expiry is an upper bound.
    deny = {'concurrency', math.min(1000, math.ceil((tonumber(first[2]) - now) / 1000)), max_cc}
  end
end
if deny and not force then return {0, deny[1], deny[2], deny[3]} end

-- Every check passed (or the debit is forced): write everything.
bucket_store(KEYS[1], rq - req_cost, req_cap, req_rate, now)
bucket_store(KEYS[2], tk - tok_cost, tok_cap, tok_rate, now)
local lease_ms = math.ceil(lease_ttl / 1000)
if burst_max > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
  redis.call('ZADD', KEYS[3], now, rid)
  redis.call('PEXPIRE', KEYS[3], math.ceil(window / 1000) + 1)
  in_window = in_window + 1
end
if max_cc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('ZADD', KEYS[4], now + lease_ttl, rid)
  redis.call('PEXPIRE', KEYS[4], lease_ms)
  running = running + 1
end
redis.call('HSET', KEYS[5], 'tok', ARGV[12])
redis.call('PEXPIRE', KEYS[5], lease_ms)
return {1, rq - req_cost, tk - tok_cost, running, in_window, deny and deny[1] or ''}
