-- ARGV: ns, member, id, lease end (unix time), lease ms
redis.call('ZADD', KEYS[5], ARGV[4], ARGV[2])
extend(skey(ARGV[3]), tonumber(ARGV[5]))
return 1
