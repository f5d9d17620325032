-- batch_delete: remove a file, unless an open batch reads it.
-- KEYS: 1 files zset, 2 usage hash, 3 meta, 4 index, 5 tenant's open set, 6.. parts, then the
-- open batches' hashes (ARGV[3] of them, as the caller read the open set).
-- ARGV: 1 file id, 2 number of parts, 3 number of open batches passed.
-- Returns 1 deleted, 0 no such file, -1 in use, -2 the open set changed meanwhile (read again).
local parts, open = tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('SCARD', KEYS[5]) ~= open then
  return -2
end
if redis.call('EXISTS', KEYS[3]) == 0 then
  return 0
end
for i = 6 + parts, 5 + parts + open do
  if redis.call('HGET', KEYS[i], 'input_file_id') == ARGV[1] then
    return -1
  end
end
redis.call('DEL', KEYS[3], KEYS[4])
for i = 6, 5 + parts do
  redis.call('DEL', KEYS[i])
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
