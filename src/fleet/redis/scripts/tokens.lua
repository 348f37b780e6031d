-- Takes (`ARGV[1]` = 'take') or gives back ('give') tokens of the token buckets of one scope,
-- on Redis's clock. A bucket is one theoretical arrival time per kind (GCRA, weighted by the
-- tokens): it holds `cap - (tat - now) * refill`, at most `cap`. A take books its tokens at
-- once, in the order takes arrive, and answers when they are in hand: across processes, a
-- large request is not passed over by small ones that come after it. A take whose tokens
-- would come later than it may wait (`ARGV[2]` ms) books nothing and is refused. A give
-- returns what an answer did not use (a negative amount takes what it used beyond).
-- Per kind k (1 input, 2 output, 3 combined), from `ARGV[3 + 6 (k - 1)]`: the limit (0: not
-- paced by the caller), the refill (tokens per ms), the amount, the level a bucket Redis
-- does not hold starts from (what the server last said was left), a floor (negative: none):
-- what the server said was left since the caller's last call, refilled to now, which the
-- bucket is lowered to (the server counts every client of the limit, Redis only the
-- bookings), and the floor's age (ms): when the server said so.
-- A floor is a count the server made before the bookings that went since: those are taken
-- off it. `KEYS[2]` logs the bookings (a sorted set: the time a booking's tokens were in
-- hand, the running totals of every kind's takes after it) for `WINDOW` ms; the hash keeps
-- the running totals (`n<k>`) and the totals of the newest booking dropped from the log
-- (`b<k>`), taken for a floor older than the log (an under-count: the safe side is lost
-- only for a floor that old).
-- Returns a code (1 booked or given, 0 refused), the wait (µs), and each kind's level after
-- (a string; empty for a kind not paced).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local take = ARGV[1] == 'take'
local max_wait = tonumber(ARGV[2])
local WINDOW = 2000
local function totals(s)
  local a, b, c = string.match(s, '^([^:]+):([^:]+):([^:]+)$')
  return {tonumber(a), tonumber(b), tonumber(c)}
end
local function field(name)
  return tonumber(redis.call('HGET', KEYS[1], name) or '0') or 0
end
-- The log's oldest bookings leave it; the newest of them is kept as the base.
local gone = redis.call('ZREVRANGEBYSCORE', KEYS[2], '(' .. (now - WINDOW), '-inf', 'LIMIT', 0, 1)
if gone[1] then
  local b = totals(gone[1])
  redis.call('HSET', KEYS[1], 'b1', tostring(b[1]), 'b2', tostring(b[2]), 'b3', tostring(b[3]))
  redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. (now - WINDOW))
end
local n = {field('n1'), field('n2'), field('n3')}
-- The totals of the bookings whose tokens were in hand by `at`: counted by the server then.
local counted = {}
local function counted_by(at)
  local key = tostring(at)
  if counted[key] == nil then
    local e = redis.call('ZREVRANGEBYSCORE', KEYS[2], at, '-inf', 'LIMIT', 0, 1)
    counted[key] = e[1] and totals(e[1]) or {field('b1'), field('b2'), field('b3')}
  end
  return counted[key]
end
local old, new, caps, refills, amounts = {}, {}, {}, {}, {}
local go = now
local ttl = 60000
for k = 1, 3 do
  local b = 3 + 6 * (k - 1)
  local cap, refill = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
  local amount, start = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local floor, age = tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5])
  if cap > 0 and refill > 0 then
    local tat = tonumber(redis.call('HGET', KEYS[1], 'tat' .. k) or '')
    if tat == nil then
      tat = now + (cap - math.min(start, cap)) / refill
    end
    if tat < now then tat = now end
    if floor >= 0 then
      floor = floor - (n[k] - counted_by(now - age)[k])
      tat = math.max(tat, now + (cap - math.min(floor, cap)) / refill)
    end
    old[k] = tat
    if take then
      new[k] = tat + math.min(amount, cap) / refill
      go = math.max(go, new[k] - cap / refill)
      amounts[k] = math.min(amount, cap)
    else
      new[k] = math.max(tat - amount / refill, now)
    end
    caps[k], refills[k] = cap, refill
    ttl = math.max(ttl, 2 * cap / refill)
  end
end
local code = 1
if take and go - now > max_wait then
  code = 0
  new = old
end
local out = {code, math.floor((go - now) * 1000)}
for k = 1, 3 do
  if new[k] then
    redis.call('HSET', KEYS[1], 'tat' .. k, tostring(new[k]))
    out[#out + 1] = tostring(caps[k] - (new[k] - now) * refills[k])
  else
    out[#out + 1] = ''
  end
end
if take and code == 1 then
  for k = 1, 3 do
    n[k] = n[k] + (amounts[k] or 0)
  end
  local totals_after = tostring(n[1]) .. ':' .. tostring(n[2]) .. ':' .. tostring(n[3])
  redis.call('HSET', KEYS[1], 'n1', tostring(n[1]), 'n2', tostring(n[2]), 'n3', tostring(n[3]))
  redis.call('ZADD', KEYS[2], go, totals_after)
end
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl))
redis.call('PEXPIRE', KEYS[2], math.ceil(ttl))
return out
