-- ARGV: ns, id, blob, owner, created, last_used, ttl, expires_at, size, ttl_ms, deadline (Redis's unix time in ms),
-- the revision the work read, the new revision, the applied entry of the observe it is ("" for none: a line, its
-- idempotency key up to the first space), how many entries a session keeps
-- -> 1, 0 if it is gone, -1 if it came after its deadline (nothing written: see `RedisSessionStore.update`), -2 if
-- the stored revision is not the one the work read (another server wrote the session meanwhile; nothing written),
-- -3 if its idempotency key is applied already (nothing written)
local id = ARGV[2]
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[11]) then return -1 end
if redis.call('EXISTS', skey(id)) == 0 then return 0 end
if (redis.call('HGET', skey(id), 'revision') or '') ~= ARGV[12] then return -2 end
local applied = nil
if ARGV[14] ~= '' then
  -- the key is recorded in this write, with the state: an observe whose reply is lost is applied with its key
  local key, lines = string.match(ARGV[14], '^(%S+)'), {}
  for line in string.gmatch(redis.call('HGET', skey(id), 'applied') or '', '[^\n]+') do
    if string.match(line, '^(%S+)') == key then return -3 end
    table.insert(lines, line)
  end
  table.insert(lines, ARGV[14])
  while #lines > tonumber(ARGV[15]) do table.remove(lines, 1) end
  applied = table.concat(lines, '\n')
end
write(id, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[13])
if applied then redis.call('HSET', skey(id), 'applied', applied) end
extend(skey(id), tonumber(ARGV[10]))
return 1
