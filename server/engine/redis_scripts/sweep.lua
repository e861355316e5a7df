-- ARGV: ns, now, limit -> index entries dropped because Redis expired their key
local n = 0
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[2], 'LIMIT', 0, tonumber(ARGV[3]))) do
  if redis.call('EXISTS', skey(id)) == 0 then unindex(id); n = n + 1 end
end
redis.call('ZREMRANGEBYSCORE', KEYS[5], '-inf', ARGV[2])
return n
