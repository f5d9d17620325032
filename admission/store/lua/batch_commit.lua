-- batch_commit: a file's bytes are all stored: write its meta, give every key the file's life,
-- count its real size against the tenant's quota. Rewriting the same file is harmless (a
-- finalize redone writes the same output).
-- KEYS: 1 files zset, 2 usage hash, 3 meta hash, 4 index, 5.. the parts.
-- ARGV: 1 file id, 2 bytes, 3 expires_at (s), 4 life (s), 5 index bytes ("" for none),
-- 6.. meta field/value pairs.
redis.call('DEL', KEYS[3])
redis.call('HSET', KEYS[3], unpack(ARGV, 6))
redis.call('EXPIRE', KEYS[3], ARGV[4])
if ARGV[5] ~= '' then
  redis.call('SET', KEYS[4], ARGV[5], 'EX', ARGV[4])
end
for i = 5, #KEYS do
  redis.call('EXPIRE', KEYS[i], ARGV[4])
end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return 1
