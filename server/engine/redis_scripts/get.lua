-- ARGV: ns, id, owner, touch ("1" or "0"), now -> {blob, owner, created, last_used, ttl, revision, applied}, or nil
local id = ARGV[2]
local k = skey(id)
local f = redis.call('HMGET', k, 'blob', 'owner', 'created', 'last_used', 'ttl', 'revision', 'applied')
if not f[1] or f[2] ~= ARGV[3] then return false end
f[6] = f[6] or ''  -- written before revisions: the one an update then checks for
f[7] = f[7] or ''  -- no observe applied under an idempotency key
if ARGV[4] == '1' then
  local ttl = tonumber(f[5])
  redis.call('HSET', k, 'last_used', ARGV[5])
  extend(k, math.max(1, math.ceil(ttl * 1000)))
  redis.call('ZADD', KEYS[1], ARGV[5], id)
  redis.call('ZADD', KEYS[2], tostring(tonumber(ARGV[5]) + ttl), id)
  if redis.call('HEXISTS', ns .. ':owner', id) == 1 then redis.call('ZADD', okey(ARGV[3]), ARGV[5], id) end
  f[4] = ARGV[5]
end
return f
