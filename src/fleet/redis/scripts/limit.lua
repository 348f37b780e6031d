-- A stated request limit: the cap of the fleet's rate.
local cap = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'cap', cap)
local rate = tonumber(redis.call('HGET', KEYS[1], 'rate'))
if rate and rate > cap then redis.call('HSET', KEYS[1], 'rate', cap) end
redis.call('PEXPIRE', KEYS[1], 3600000)
return tostring(math.min(rate or cap, cap))
