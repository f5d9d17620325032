-- prelude.lua: shared by every script below, prepended when the scripts are loaded.
--
-- Time is Redis TIME (µs), never the caller's clock. Buckets are hashes {l = level, t = time}
-- in integer micro-units (1e-6 request or token), rates in micro-units per second; a missing
-- bucket is a full one, and each key expires exactly when it would be full again.

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- Level of a bucket at `now`, refilled since its last write and clamped to `cap`
-- (a capacity lowered by a policy reload clamps here).
local function bucket_level(key, cap, rate, now)
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

-- Write a bucket's level; a full bucket is no key at all.
local function bucket_store(key, l, cap, rate, now)
  if l >= cap then
    redis.call('DEL', key)
    return
  end
  redis.call('HSET', key, 'l', l, 't', now)
  redis.call('PEXPIRE', key, math.max(1, math.ceil((cap - l) * 1000 / rate)))
end

