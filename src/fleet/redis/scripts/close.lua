-- Closes the gate on Redis's clock, only ever later, and publishes the new deadline.
-- Returns Redis's time, the deadline in force and the wait it was announced with.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local wait = tonumber(ARGV[2])
local until_ms = now + wait
local cur = redis.call('HMGET', KEYS[1], 'until', 'wait')
local cu = tonumber(cur[1]) or 0
if until_ms > cu then
  redis.call('HSET', KEYS[1], 'until', until_ms, 'wait', ARGV[3])
  redis.call('PEXPIREAT', KEYS[1], until_ms + 60000)
  redis.call('PUBLISH', ARGV[1], ARGV[4] .. ' ' .. wait .. ' ' .. ARGV[3])
  return {now, until_ms, tonumber(ARGV[3])}
end
return {now, cu, tonumber(cur[2]) or 0}
