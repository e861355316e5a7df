-- ARGV: ns, id, owner -> 1 if deleted
local id = ARGV[2]
if redis.call('HGET', skey(id), 'owner') ~= ARGV[3] then return 0 end
redis.call('DEL', skey(id))
unindex(id)
return 1
