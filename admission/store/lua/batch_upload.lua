-- batch_upload: may this tenant begin an upload? Its quota and rate, then a reservation.
-- KEYS: 1 files zset (id → expires_at s), 2 usage hash (id → bytes), 3 uploads zset (id → s).
-- ARGV: 1 now (s), 2 file id, 3 bytes it may take, 4 max files, 5 max bytes, 6 uploads per
-- minute, 7 when the reservation lapses (s) if the upload never ends.
-- Returns {1, bytes used} or {-1, 0} too many files, {-2, bytes used} over the byte quota,
-- {-3, seconds until an upload slot frees} over the rate.
local now = tonumber(ARGV[1])
-- Files whose time is up: Redis has expired their keys; their bytes stop counting.
local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #gone > 0 then
  redis.call('HDEL', KEYS[2], unpack(gone))
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - 60)
if redis.call('ZCARD', KEYS[3]) >= tonumber(ARGV[6]) then
  local oldest = redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')
  return {-3, math.max(1, math.ceil(tonumber(oldest[2]) + 60 - now))}
end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then
  return {-1, 0}
end
local used = 0
for _, v in ipairs(redis.call('HVALS', KEYS[2])) do used = used + tonumber(v) end
if used + tonumber(ARGV[3]) > tonumber(ARGV[5]) then
  return {-2, used}
end
redis.call('ZADD', KEYS[3], now, ARGV[2])
redis.call('ZADD', KEYS[1], ARGV[7], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[2], ARGV[3])
return {1, used}
