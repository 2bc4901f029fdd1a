-- Release: settles what one admitted request recorded under some of its limits to the part it
-- keeps, so each stands as if the request had been admitted with the kept cost only (as
-- exactly as its algorithm allows). Used for a held request whose client left
-- (`on_exceed: delay`), for an outcome a `count:` limit does not count, to undo the admitted
-- part of a request decided in several calls (all three keep nothing), and to settle a
-- reservation to what the response says it used (a token budget keeps its usage, which may
-- be more than it reserved: an overrun, charged here), and to end a request's concurrency
-- lease. Concatenated after prelude.lua, every algorithm's file and the `release` and
-- `charge` dispatchers generated from the algorithm table (src/limiter/algorithm.rs,
-- src/limiter/redis/scripts.rs), which call `{algorithm}_release` and `{algorithm}_charge`.
--
-- KEYS[i]      the keys the request was recorded under (any subset of its checks)
-- ARGV[1]      the request's member prefix (decide.lua's ARGV[1])
-- ARGV[2]      at_us: when it was recorded in the exact algorithms (decide.lua's at_us)
-- ARGV[3]      decided_us: when it was decided (decide.lua's now_us): the counters'
--              record time
-- ARGV[5i-1..5i+3]  the limit of KEYS[i]: algorithm, requests, window in microseconds, cost
--              (what the request recorded), keep (the units it keeps: 0..cost to give
--              back, above cost to charge an overrun)
--
-- Returns the number of keys that held something to give back or to charge.
--
-- Each algorithm's file says how exactly it gives back `back` = cost - keep units
-- (`{algorithm}_release`, true when the key held something) and, for the algorithms that
-- settle exactly (the table's `settles_exactly`), how it charges an overrun (keep > cost,
-- `{algorithm}_charge`): where the request is still recorded, at the time it is recorded at, so
-- the window makes its identity wait for what it really spent (this can take a limit past
-- `requests`: the units were spent upstream already). A request no longer there (reset by the
-- admin API, gone from its window or period) is not charged. The other algorithms charge
-- nothing: a token budget, the only caller that charges, runs only on those that settle
-- exactly.
--
-- Every key keeps an expiry: a key written here exists already and keeps its TTL (ZADD,
-- INCRBY, DECRBY, HDEL and HSET leave it; SET is given PX). A key that would be re-created
-- is written only if it exists (as the release functions that re-add an entry do).

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local member = ARGV[1]
local at = tonumber(ARGV[2])
local decided = tonumber(ARGV[3])
local released = 0

for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 5 * i - 1
  local algorithm = ARGV[base]
  local requests = tonumber(ARGV[base + 1])
  local window = tonumber(ARGV[base + 2])
  local keep = tonumber(ARGV[base + 4])
  local back = tonumber(ARGV[base + 3]) - keep
  local held
  if back == 0 then
    -- Everything is kept: nothing to give back or charge.
    held = false
  elseif back < 0 then
    held = charge(algorithm, key, requests, -back, keep + back, member)
  else
    held = release(algorithm, key, now, requests, window, back, keep, member, at, decided)
  end
  if held == nil then
    return redis.error_reply('unknown algorithm ' .. tostring(algorithm))
  end
  if held then
    released = released + 1
  end
end
return released
