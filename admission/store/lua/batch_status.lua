-- batch_status: move a batch to a status (stamping <status>_at) if its current one is allowed.
-- KEYS: 1 batch hash, 2 tenant's open set. ARGV: 1 status, 2 now (s), 3 batch id, 4 "1" when
-- the status is terminal (the batch leaves the open set), 5.. allowed current statuses (none:
-- any). Returns 1 moved, 0 not.
if #ARGV > 4 then
  local cur = redis.call('HGET', KEYS[1], 'status') or ''
  local ok = false
  for i = 5, #ARGV do
    if ARGV[i] == cur then ok = true end
  end
  if not ok then return 0 end
end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[1] .. '_at', ARGV[2])
if ARGV[4] == '1' then
  redis.call('SREM', KEYS[2], ARGV[3])
end
return 1
