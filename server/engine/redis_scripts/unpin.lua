-- ARGV: ns, member, id, now: drop this server's lease; unless another server holds one, the session expires
-- again ttl after its last use (at once if that has passed)
redis.call('ZREM', KEYS[5], ARGV[2])
if pinned(ARGV[4])[ARGV[3]] then return 0 end
local k = skey(ARGV[3])
local f = redis.call('HMGET', k, 'last_used', 'ttl')
if not f[1] then return 0 end
local left = math.floor((tonumber(f[1]) + tonumber(f[2]) - tonumber(ARGV[4])) * 1000)
redis.call('PEXPIRE', k, math.max(left, 1))
return 1
