-- ARGV: ns, id, owner, created, last_used, ttl, expires_at, size, ttl_ms, deadline (Redis's unix time in ms),
-- the revision the work read, the new revision, the applied entry of the observe it is ("" for none: a line, its
-- idempotency key up to the first space), how many entries a session keeps, whole ("1": the state fields given are
-- all of it, every other state field goes; "0": they are the parts that changed over the revision read), n, then
-- n state fields to delete, then the state's field, value pairs to set
-- -> 1, 0 if it is gone, -1 if it came after its deadline (nothing written: see `RedisSessionStore.update`), -2 if
-- the stored revision is not the one the work read (another server wrote the session meanwhile; nothing written),
-- -3 if its idempotency key is applied already (nothing written)
local id = ARGV[2]
local k = skey(id)
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[10]) then return -1 end
if redis.call('EXISTS', k) == 0 then return 0 end
-- the revision check is what makes a write of parts safe: the parts not sent are those of the revision read
if (redis.call('HGET', k, 'revision') or '') ~= ARGV[11] then return -2 end
local applied = nil
if ARGV[13] ~= '' then
  -- the key is recorded in this write, with the state: an observe whose reply is lost is applied with its key
  local key, lines = string.match(ARGV[13], '^(%S+)'), {}
  for line in string.gmatch(redis.call('HGET', k, 'applied') or '', '[^\n]+') do
    if string.match(line, '^(%S+)') == key then return -3 end
    table.insert(lines, line)
  end
  table.insert(lines, ARGV[13])
  while #lines > tonumber(ARGV[14]) do table.remove(lines, 1) end
  applied = table.concat(lines, '\n')
end
write(id, ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[12])
local n = tonumber(ARGV[16])
if ARGV[15] == '1' then clear_state(k)
elseif n > 0 then redis.call('HDEL', k, unpack(ARGV, 17, 16 + n)) end
set_state(k, 17 + n)
if applied then redis.call('HSET', k, 'applied', applied) end
extend(k, tonumber(ARGV[9]))
return 1
