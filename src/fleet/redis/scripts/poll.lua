-- Reads the gate and says this process is alive. Returns Redis's time, the gate's deadline
-- and announced wait (0 when open), the number of live processes and the pacing rate (an
-- empty string when there is none yet).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local live = tonumber(ARGV[2])
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now - live)
redis.call('PEXPIRE', KEYS[2], live * 2)
local n = redis.call('ZCARD', KEYS[2])
local g = redis.call('HMGET', KEYS[1], 'until', 'wait')
local rate = redis.call('HGET', KEYS[3], 'rate')
return {now, tonumber(g[1]) or 0, tonumber(g[2]) or 0, n, rate or ''}
