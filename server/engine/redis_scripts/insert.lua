-- ARGV: ns, now, id, owner, created, last_used, ttl, expires_at, size, ttl_ms, max_sessions, max_bytes, revision,
-- owner_max_sessions, owner_max_bytes (one owner's share: only the idle sessions of owners over it make room), then
-- the state's field, value pairs (all of it)
-- -> {evicted (lru), expired (ttl), applied (the keys the replaced record passed on, "" for none)}, evicted = -1:
-- does not fit (nothing evicted, nothing stored)
local now, id, owner, size = ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[9])
local max_n, max_b = tonumber(ARGV[11]), tonumber(ARGV[12])
local own_n, own_b = tonumber(ARGV[14]), tonumber(ARGV[15])
local count = redis.call('ZCARD', KEYS[1])
local bytes = tonumber(redis.call('GET', KEYS[4]) or '0')
local owned, owned_b = {}, {}  -- owner -> its sessions and bytes, read once, then kept as victims are chosen
local function load(o)
  if owned[o] == nil then
    owned[o] = redis.call('ZCARD', okey(o))
    owned_b[o] = tonumber(redis.call('HGET', ns .. ':obytes', o) or '0')
  end
end
-- The owner a session is counted for; false for a record written before the owner index (by an older server):
-- no owner's count holds it, so it makes room as every session did then, least recently used first
local function owner_of(v) return redis.call('HGET', ns .. ':owner', v) end
local function over(o) return owned[o] > own_n or owned_b[o] > own_b end
local function size_of(v) return tonumber(redis.call('HGET', KEYS[3], v) or '0') end
local function gone(v) return redis.call('EXISTS', skey(v)) == 0 end  -- expired: Redis dropped its key
load(owner)
local old = redis.call('HGET', KEYS[3], id)
if old then
  count = count - 1; bytes = bytes - tonumber(old)
  local was = owner_of(id)
  if was then load(was); owned[was] = owned[was] - 1; owned_b[was] = owned_b[was] - tonumber(old) end
end
owned[owner] = owned[owner] + 1; owned_b[owner] = owned_b[owner] + size  -- the new session counts for its owner
local function fits() return count + 1 <= max_n and bytes + size <= max_b end
local expired, victims, taken = {}, {}, {}
local function take(v, o, expiry)  -- out of the books (o: its owner, false for none), expired or evicted
  local s = size_of(v)
  taken[v] = true
  table.insert(expiry and expired or victims, v)
  count = count - 1; bytes = bytes - s
  if o then owned[o] = owned[o] - 1; owned_b[o] = owned_b[o] - s end
end
-- Expired sessions make room first, however recently used: their index entries are among those whose expiry has
-- passed (where the key of a pinned session is still there, its lease extending it)
local start = 0
while not fits() do
  local batch = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now, 'LIMIT', start, 100)
  if #batch == 0 then break end
  for _, v in ipairs(batch) do
    if fits() then break end
    if v ~= id and gone(v) then
      local o = owner_of(v)
      if o then load(o) end
      take(v, o, true)
    end
  end
  start = start + 100
end
if not fits() and redis.call('HLEN', ns .. ':owner') < redis.call('ZCARD', KEYS[1]) then
  -- Records of an older server, counted for no owner (`owner_of`), are in the LRU order only: the walk down it,
  -- which steps over every session of an owner within its share (the cost the merge below avoids)
  local pins = pinned(now)
  start = 0
  while not fits() do
    local batch = redis.call('ZRANGE', KEYS[1], start, start + 99)  -- least recently used first
    if #batch == 0 then break end
    for _, v in ipairs(batch) do
      if fits() then break end
      if v ~= id and not taken[v] then
        local o = owner_of(v)
        if o then load(o) end
        local expiry = gone(v)
        -- an idle session makes room only if its owner is over its share (or it is counted for no owner)
        if expiry or (not pins[v] and (not o or over(o))) then take(v, o, expiry) end
      end
    end
    start = start + 100
  end
elseif not fits() then
  -- The sessions that walk would take, read from the owners over their share only: the least recently used idle
  -- session among their orders (by last use, as the LRU order, a tie broken as there: by rank), until it fits;
  -- an owner within its share after a victim gives no more
  local pins = pinned(now)
  local heads = {}  -- per owner over its share: a batch of its order (id, score, ...) and where it is in it
  local all = redis.call('HGETALL', ns .. ':obytes')  -- owner, bytes, ...: every owner
  for i = 1, #all, 2 do
    local o = all[i]
    if owned[o] == nil then owned[o], owned_b[o] = redis.call('ZCARD', okey(o)), tonumber(all[i + 1]) end
    if over(o) then table.insert(heads, {owner = o, batch = {}, at = 1, start = 0}) end
  end
  local function head(h)  -- its owner's next session and its last use, or nil
    if h.at > #h.batch then
      h.batch, h.at = redis.call('ZRANGE', okey(h.owner), h.start, h.start + 31, 'WITHSCORES'), 1
      h.start = h.start + 32
    end
    if h.at > #h.batch then return nil end
    return h.batch[h.at], tonumber(h.batch[h.at + 1])
  end
  local function before(v, t, w, u)  -- v (last used t) before w (u) in the LRU order?
    if t ~= u then return t < u end
    return redis.call('ZRANK', KEYS[1], v) < redis.call('ZRANK', KEYS[1], w)
  end
  while not fits() do
    local best, v, t
    for _, h in ipairs(heads) do
      if not h.done then
        local w, u = head(h)
        if w == nil then h.done = true
        elseif best == nil or before(w, u, v, t) then best, v, t = h, w, u end
      end
    end
    if best == nil then break end
    best.at = best.at + 2
    if v ~= id and not taken[v] then
      local expiry = gone(v)
      if expiry or not pins[v] then
        take(v, best.owner, expiry)
        best.done = not over(best.owner)
      end
    end
  end
end
for _, v in ipairs(expired) do unindex(v) end
if not fits() then return {-1, #expired} end
for _, v in ipairs(victims) do redis.call('DEL', skey(v)); unindex(v) end
-- a replaced record of the same owner passes on the idempotency keys applied to it (see update.lua)
local kept = redis.call('HMGET', skey(id), 'owner', 'applied')
redis.call('DEL', skey(id))
write(id, ARGV[4], ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9], ARGV[13])
set_state(skey(id), 16)
local applied = ''
if kept[2] and kept[1] == owner then applied = kept[2]; redis.call('HSET', skey(id), 'applied', applied) end
redis.call('PEXPIRE', skey(id), ARGV[10])
return {#victims, #expired, applied}
