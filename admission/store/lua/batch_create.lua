-- batch_create: open a batch if the tenant has fewer than max_open open (checked and taken in
-- one step: concurrent creates cannot pass the bound), and keep its input file until then.
-- KEYS: 1 batch hash, 2 tenant's batches zset, 3 tenant's open set, 4 files zset, 5 input meta,
-- 6 input index, 7.. input parts.
-- ARGV: 1 batch id, 2 max open, 3 created_at, 4 keep the input until (s), 5 input file id,
-- 6.. batch field/value pairs.
-- Returns 1 created, 0 too many open, -1 no such input file.
-- A batch's record lives until its input's keep time; the tenant's list keeps the batches
-- created since then, at most MAX_LISTED (the oldest leave first): both are bounded.
local MAX_LISTED = 10000
if redis.call('EXISTS', KEYS[5]) == 0 then
  return -1
end
if redis.call('SCARD', KEYS[3]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 6))
redis.call('EXPIREAT', KEYS[1], ARGV[4])
local life = tonumber(ARGV[4]) - tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (tonumber(ARGV[3]) - life))
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
redis.call('ZREMRANGEBYRANK', KEYS[2], 0, -(MAX_LISTED + 1))
redis.call('EXPIREAT', KEYS[2], ARGV[4])
redis.call('SADD', KEYS[3], ARGV[1])
local keep = tonumber(ARGV[4])
if keep > tonumber(redis.call('ZSCORE', KEYS[4], ARGV[5]) or 0) then
  for i = 5, #KEYS do
    redis.call('EXPIREAT', KEYS[i], keep)
  end
  redis.call('ZADD', KEYS[4], keep, ARGV[5])
end
return 1
