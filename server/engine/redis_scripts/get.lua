-- ARGV: ns, id, owner, touch ("1" or "0"), now, the revision of the caller's copy ("" for none)
-- -> {owner, created, last_used, ttl, revision, applied, field, value, ...: the stored state's fields (is_state)};
-- {last_used} if the stored revision is the caller's (its copy is current: the state is not sent); nil if there is
-- none for owner
local id = ARGV[2]
local k = skey(id)
local f = redis.call('HMGET', k, 'owner', 'created', 'last_used', 'ttl', 'revision', 'applied')
if not f[1] or f[1] ~= ARGV[3] then return false end
local revision = f[5] or ''  -- written before revisions: the one an update then checks for
if ARGV[4] == '1' then
  local ttl = tonumber(f[4])
  redis.call('HSET', k, 'last_used', ARGV[5])
  extend(k, math.max(1, math.ceil(ttl * 1000)))
  redis.call('ZADD', KEYS[1], ARGV[5], id)
  redis.call('ZADD', KEYS[2], tostring(tonumber(ARGV[5]) + ttl), id)
  if redis.call('HEXISTS', ns .. ':owner', id) == 1 then redis.call('ZADD', okey(ARGV[3]), ARGV[5], id) end
  f[3] = ARGV[5]
end
-- every field but last_used changes only with a write, and every write makes a new revision
if revision ~= '' and revision == ARGV[6] then return {f[3]} end
local out = {f[1], f[2], f[3], f[4], revision, f[6] or ''}  -- applied: '' when no observe had a key
local all = redis.call('HGETALL', k)
for i = 1, #all, 2 do
  if is_state(all[i]) then table.insert(out, all[i]); table.insert(out, all[i + 1]) end
end
return out
