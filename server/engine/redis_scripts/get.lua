-- ARGV: ns, id, owner, touch ("1" or "0"), now, the revision of the caller's copy ("" for none)
-- -> {blob, owner, created, last_used, ttl, revision, applied}; {last_used} if the stored revision is the caller's
-- (its copy is current: the blob is not sent); nil if there is none for owner
local id = ARGV[2]
local k = skey(id)
local f = redis.call('HMGET', k, 'owner', 'created', 'last_used', 'ttl', 'revision')
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
local g = redis.call('HMGET', k, 'blob', 'applied')
return {g[1], f[1], f[2], f[3], f[4], revision, g[2] or ''}  -- applied: '' when no observe had a key
