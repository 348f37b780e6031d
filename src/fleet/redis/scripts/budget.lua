-- The fleet-wide budget: deposits and withdrawals counted in slots of Redis's clock over
-- one window, as `TpsBudget` counts them in one process. Adds this process's deposits (and
-- the retries it made beyond its grant, if any), takes back the grant it holds, and grants
-- up to `want` anew from what the window allows: `reserve + ratio × deposits −
-- withdrawals`. Returns the grant and the slot it is counted in.
local done = redis.call('GET', KEYS[2])
if done then
  local id, grant, cur = string.match(done, '^(%d+):(%d+):(%d+)$')
  if id == ARGV[10] then return {tonumber(grant), tonumber(cur)} end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local slot_ms = tonumber(ARGV[1])
local slots = tonumber(ARGV[2])
local cur = math.floor(now / slot_ms)
local first = cur - slots + 1
local dep = tonumber(ARGV[5])
if dep > 0 then redis.call('HINCRBY', KEYS[1], 'd' .. cur, dep) end
local ret = tonumber(ARGV[6])
local rslot = tonumber(ARGV[7])
if ret > 0 and rslot >= first then redis.call('HINCRBY', KEYS[1], 'w' .. rslot, -ret) end
local debt = tonumber(ARGV[9])
if debt > 0 then redis.call('HINCRBY', KEYS[1], 'w' .. cur, debt) end
local all = redis.call('HGETALL', KEYS[1])
local d, w = 0, 0
for i = 1, #all, 2 do
  local f = all[i]
  local s = tonumber(string.sub(f, 2))
  local v = tonumber(all[i + 1])
  if s == nil or s < first then
    redis.call('HDEL', KEYS[1], f)
  elseif string.sub(f, 1, 1) == 'd' then
    d = d + v
  else
    w = w + v
  end
end
local balance = tonumber(ARGV[3]) + tonumber(ARGV[4]) * d - w
local grant = math.max(0, math.min(tonumber(ARGV[8]), math.floor(balance)))
if grant > 0 then redis.call('HINCRBY', KEYS[1], 'w' .. cur, grant) end
redis.call('PEXPIRE', KEYS[1], slot_ms * slots * 2)
redis.call('SET', KEYS[2], ARGV[10] .. ':' .. grant .. ':' .. cur, 'PX', slot_ms * slots * 2)
return {grant, cur}
