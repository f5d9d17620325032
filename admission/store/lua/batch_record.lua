-- batch_record: record one line's answer once, count it, say how far the batch is.
-- KEYS: 1 results hash, 2 batch hash. ARGV: 1 line index, 2 "1"|"0" + answer JSON,
-- 3 "completed"|"failed", 4 when the answers expire at the latest (s: the batch's window's end
-- plus an output file's life; the worker deletes them once the output file is committed).
-- Returns {recorded (0/1), answered lines, total}.
local recorded = redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2])
redis.call('EXPIREAT', KEYS[1], ARGV[4])
if recorded == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
end
local b = redis.call('HMGET', KEYS[2], 'completed', 'failed', 'total')
return {recorded, tonumber(b[1] or 0) + tonumber(b[2] or 0), tonumber(b[3] or 0)}
