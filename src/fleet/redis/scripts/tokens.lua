-- Takes (`ARGV[1]` = 'take') or gives back ('give') tokens of the token buckets of one scope,
-- on Redis's clock. A bucket is one theoretical arrival time per kind (GCRA, weighted by the
-- tokens): it holds `cap - (tat - now) * refill`, at most `cap`. A take books its tokens at
-- once, in the order takes arrive, and answers when they are in hand: across processes, a
-- large request is not passed over by small ones that come after it. A take whose tokens
-- would come later than it may wait (`ARGV[2]` ms) books nothing and is refused. A give
-- returns what an answer did not use (a negative amount takes what it used beyond).
-- Per kind k (1 input, 2 output, 3 combined), from `ARGV[3 + 5 (k - 1)]`: the limit (0: not
-- paced by the caller), the refill (tokens per ms), the amount, the level a bucket Redis
-- does not hold starts from (what the server last said was left), and a floor (negative:
-- none): what the server said was left since the caller's last call, refilled to now, which
-- the bucket is lowered to (the server counts every client of the limit, Redis only the
-- bookings).
-- Returns a code (1 booked or given, 0 refused), the wait (µs), and each kind's level after
-- (a string; empty for a kind not paced).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local take = ARGV[1] == 'take'
local max_wait = tonumber(ARGV[2])
local old, new, caps, refills = {}, {}, {}, {}
local go = now
local ttl = 60000
for k = 1, 3 do
  local b = 3 + 5 * (k - 1)
  local cap, refill = tonumber(ARGV[b]), tonumber(ARGV[b + 1])
  local amount, start = tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
  local floor = tonumber(ARGV[b + 4])
  if cap > 0 and refill > 0 then
    local tat = tonumber(redis.call('HGET', KEYS[1], 'tat' .. k) or '')
    if tat == nil then
      tat = now + (cap - math.min(start, cap)) / refill
    end
    if tat < now then tat = now end
    if floor >= 0 then
      tat = math.max(tat, now + (cap - math.min(floor, cap)) / refill)
    end
    old[k] = tat
    if take then
      new[k] = tat + math.min(amount, cap) / refill
      go = math.max(go, new[k] - cap / refill)
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
redis.call('PEXPIRE', KEYS[1], math.ceil(ttl))
return out
