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


-- Prefix blocks a node lease holds (lease.lua): ledger field b:<ticket> = "<tokens per block>
-- <hash> <hash> …", a hash marked '+' where the lease brought the block to the node (neither
-- resident nor held before it), reference counts in ledger fields h:<hash>, residency in the
-- node's prefixes zset (hash → µs last used). Let go of a ticket's blocks: each count goes
-- down; a block nobody holds any more stays resident (the engine keeps computed blocks until it
-- needs the room, least recently released first) and its tokens leave the ledger's kv, where
-- the lease that first held it had booked them. `ran` false: the request never ran on this
-- lease (refused, given back, booked again): a block it brought that nobody else took was never
-- computed, and leaves the node's resident set. `ran` 'unconfirmed': the request ran but the
-- engine found none of the head it was booked as holding (its key differs from the
-- fingerprint's, or the engine evicted it): every block of it nobody else holds leaves the
-- resident set, so the next copy is booked as computing it. Returns the KV tokens freed.
local function prefix_unhold(ledger, resident, ticket, now, ran)
  local held = redis.call('HGET', ledger, 'b:' .. ticket)
  if not held then return 0 end
  redis.call('HDEL', ledger, 'b:' .. ticket)
  local freed, size, i = 0, nil, 0
  for w in string.gmatch(held, '%S+') do
    if size == nil then
      size = tonumber(w)
    else
      local brought = string.sub(w, 1, 1) == '+'
      if brought then w = string.sub(w, 2) end
      local n = redis.call('HINCRBY', ledger, 'h:' .. w, -1)
      if n <= 0 then
        redis.call('HDEL', ledger, 'h:' .. w)
        if (brought and not ran) or ran == 'unconfirmed' then
          redis.call('ZREM', resident, w)
        else
          -- A prompt's tail is the least shared part: it goes first (vLLM frees tail first).
          redis.call('ZADD', resident, 'XX', now - i, w)
        end
        freed = freed + size
      end
      i = i + 1
    end
  end
  return freed
end
