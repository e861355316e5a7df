-- The start of every script here (server/engine/_redis.py runs each after this file): the keys, the namespace
-- and the functions they share.
-- KEYS: lru, exp, size, bytes, pins. ARGV[1]: the namespace.
local ns = ARGV[1]
local function skey(id) return ns .. ':s:' .. id end
local function okey(owner) return ns .. ':o:' .. owner end
local function disown(owner, id, size)  -- id is no longer counted for owner; an owner of none is forgotten
  redis.call('ZREM', okey(owner), id)
  if redis.call('ZCARD', okey(owner)) == 0 then redis.call('HDEL', ns .. ':obytes', owner)
  else redis.call('HINCRBY', ns .. ':obytes', owner, -size) end
end
local function unindex(id)
  local size = redis.call('HGET', KEYS[3], id)
  if size then redis.call('DECRBY', KEYS[4], size) end
  local owner = redis.call('HGET', ns .. ':owner', id)
  if owner then
    disown(owner, id, tonumber(size or '0'))
    redis.call('HDEL', ns .. ':owner', id)
  end
  redis.call('ZREM', KEYS[1], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('HDEL', KEYS[3], id)
end
local function pinned(now)
  local ids = {}
  for _, member in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '(' .. now, '+inf')) do
    ids[string.match(member, '^[^|]*|(.*)$')] = true
  end
  return ids
end
local function extend(key, ms)  -- PEXPIRE ... GT, also on Redis 6
  local left = redis.call('PTTL', key)
  if left >= 0 and left < ms then redis.call('PEXPIRE', key, ms) end
end
-- A session's stored state: 'blob' (the whole export: the form of records written before the parts), or 'hdr',
-- 'lay' and 'c:<tensor>:<i>' (the export in parts: server/engine/_redis_form.py); the other fields are the record's
-- bookkeeping (owner, created, last_used, ttl, revision, applied)
local function is_state(field)
  return field == 'blob' or field == 'hdr' or field == 'lay' or string.sub(field, 1, 2) == 'c:'
end
local function clear_state(k)  -- every stored state field of k (before a whole write)
  local stale = {}
  for _, field in ipairs(redis.call('HKEYS', k)) do
    if is_state(field) then table.insert(stale, field) end
  end
  for i = 1, #stale, 1000 do redis.call('HDEL', k, unpack(stale, i, math.min(i + 999, #stale))) end
end
local function set_state(k, first)  -- the field, value pairs ARGV[first], ARGV[first + 1], ... (none: nothing)
  for i = first, #ARGV, 1000 do redis.call('HSET', k, unpack(ARGV, i, math.min(i + 999, #ARGV))) end
end
-- the record's bookkeeping and the indexes; its state fields are set_state's
local function write(id, owner, created, last_used, ttl, expires_at, size, revision)
  local k = skey(id)
  redis.call('HSET', k, 'owner', owner, 'created', created, 'last_used', last_used, 'ttl', ttl,
             'revision', revision)
  redis.call('ZADD', KEYS[1], last_used, id)
  redis.call('ZADD', KEYS[2], expires_at, id)
  local old = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HSET', KEYS[3], id, size)
  redis.call('INCRBY', KEYS[4], tonumber(size) - old)
  local was = redis.call('HGET', ns .. ':owner', id)
  if was then disown(was, id, old) end
  redis.call('HSET', ns .. ':owner', id, owner)
  redis.call('ZADD', okey(owner), last_used, id)
  redis.call('HINCRBY', ns .. ':obytes', owner, tonumber(size))
end
