-- Reserves slots of the fleet's pacing schedule (GCRA: one theoretical arrival time per
-- scope) for the `n` attempts of one process that wait for one, in their order, one slot
-- each. A slot is booked only within the horizon (`ARGV[6]` ms ahead) and, of it, only this
-- process's share (one of the live processes' equal parts, at least one slot): a rate learnt now
-- then reaches the slots sent soon, instead of slots booked seconds ahead at the rate of
-- their booking, and every process gets its turn. An attempt whose slot would come later
-- than it may wait (`ARGV[8 + i]` ms) is refused; the others are asked for again when the
-- schedule has half a horizon left (after a quarter of one at the soonest).
--
-- The rate is learnt as in one process: while the schedule is booked ahead it doubles every
-- second until the first refusal (slow start), then grows by `growth` per success reported;
-- a stated limit caps it. The limit this process last saw stated (`ARGV[8]`, 0 for none)
-- caps a schedule Redis no longer holds (restarted, flushed, expired after an idle hour),
-- which the limit's own script, sent only when the limit changes, would not reach again.
-- Returns the epoch, the rate, when to ask again (µs; 0: nothing left) and, per attempt, a
-- code (1 booked, 0 refused, 2 later) and the wait (µs, from `ARGV[9]` on).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local h = redis.call('HMGET', KEYS[1], 'tat', 'rate', 'epoch', 'ss', 'cap', 'last')
local max = tonumber(ARGV[3])
local stated = tonumber(ARGV[8])
if stated <= 0 then stated = nil end
local cap = tonumber(h[5]) or stated or max
local ceiling = math.min(cap, max)
local tat = tonumber(h[1]) or now
local rate = tonumber(h[2]) or math.min(tonumber(ARGV[1]), ceiling)
local epoch = tonumber(h[3]) or 0
local ss = tonumber(h[4]) or 1
local last = tonumber(h[6]) or now
if tat > now then
  if ss == 1 then
    local dt = math.min(math.max(now - last, 0), 1000) / 1000
    rate = math.min(rate * 2 ^ dt, ceiling)
  else
    rate = math.min(rate + tonumber(ARGV[4]) * tonumber(ARGV[5]), ceiling)
  end
end
if tat < now then tat = now end
local horizon = tonumber(ARGV[6])
local procs = math.max(1, tonumber(ARGV[7]), redis.call('ZCARD', KEYS[2]))
local share = math.max(1, math.ceil(horizon * rate / 1000 / procs))
local n = #ARGV - 8
local out = {epoch, tostring(rate), 0}
local booked = 0
local ahead = tat
for i = 1, n do
  local wait = ahead - now
  local code = 2
  if wait > tonumber(ARGV[8 + i]) then
    code = 0
  elseif booked < share and wait <= horizon then
    code = 1
    booked = booked + 1
    tat = tat + 1000 / rate
  elseif out[3] == 0 then
    out[3] = math.floor(math.max(wait - horizon / 2, horizon / 4) * 1000)
  end
  if code == 1 then ahead = tat elseif code == 2 then ahead = ahead + 1000 / rate end
  out[#out + 1] = code
  out[#out + 1] = math.floor(wait * 1000)
end
redis.call('HSET', KEYS[1], 'tat', tat, 'rate', rate, 'epoch', epoch, 'ss', ss, 'cap', cap, 'last', now)
redis.call('PEXPIRE', KEYS[1], 3600000)
return out
