-- A refusal of an attempt sent in epoch `ARGV[1]`: the fleet's rate decreases once per
-- epoch, whichever process saw it (by at most half the first time, which ends slow start,
-- or more when the process measured what the server admits).
local h = redis.call('HMGET', KEYS[1], 'rate', 'epoch', 'ss', 'cap')
local epoch = tonumber(h[2]) or 0
local rate = tonumber(h[1]) or tonumber(ARGV[4])
if tonumber(ARGV[1]) < epoch then return tostring(rate) end
local f = tonumber(ARGV[2])
-- The refusal that ends slow start: by at most half, or to the share of its attempts the
-- server admitted when the process that saw it measured one (`ARGV[6]`, 1 when none).
if (tonumber(h[3]) or 1) == 1 then f = math.min(f, 0.5, tonumber(ARGV[6]) or 1) end
rate = math.max(rate * f, tonumber(ARGV[3]))
local cap = tonumber(h[4])
if cap then rate = math.min(rate, cap) end
rate = math.min(rate, tonumber(ARGV[5]))
redis.call('HSET', KEYS[1], 'rate', rate, 'epoch', epoch + 1, 'ss', 0)
redis.call('PEXPIRE', KEYS[1], 3600000)
return tostring(rate)
