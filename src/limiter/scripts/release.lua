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
-- ARGV[2]      at_us: when it was recorded in sliding_log and gcra (decide.lua's at_us)
-- ARGV[3]      decided_us: when it was decided (decide.lua's now_us): the counters'
--              record time
-- ARGV[5i-1..5i+3]  the limit of KEYS[i]: algorithm, requests, window in microseconds, cost
--              (what the request recorded), keep (the units it keeps: 0..cost to give
--              back, above cost to charge an overrun)
--
-- Returns the number of keys that held something to give back or to charge.
--
-- Per algorithm, with `back` = cost - keep units given back (each file's release function):
--   sliding_log     ZREM member:keep+1 .. member:cost. Exact.
--   weighted_log    the entry member#cost becomes member#keep at the same score (goes when
--                   keep is 0). Exact.
--   gcra            TAT -= back * T, never below now (then the key goes: a full bucket).
--                   Exact unless the TAT fell behind the clock in between (then up to
--                   back * T more than the request's share comes back, once); a request
--                   recorded after the TAT (delayed by another limit) left the TAT at its own
--                   time, which stays (less comes back).
--   fixed_window    DECRBY back, only if the key exists; at zero the key goes (the next hit
--                   starts a window, as for a fresh key). If the request's window ended in
--                   between, the give-back lands in the new window: at most `back` more,
--                   within the algorithm's documented twice the limit across a boundary.
--   sliding_window  the count of the fixed window holding decided_us (current or previous
--                   counter) drops by back, never below 0; an older window weighs nothing.
--   calendar        DECRBY back within the period's key, only if it exists; at zero the key
--                   goes. Exact: the key names the request's period, so a give-back after
--                   that period ended lands on a key that no longer counts.
--   concurrency     HDEL the request's own lease; a lease already gone (reclaimed, released
--                   before) frees nothing.
--
-- An overrun (keep > cost, `extra` = keep - cost units more than recorded) is charged where
-- the request is still recorded (each file's charge function, for the algorithms that settle
-- exactly), at the time it was recorded, so the window makes its
-- identity wait for what it really spent (this can take a limit past `requests`: the units
-- were spent upstream already). A request no longer there (reset by the admin API, left its
-- window or period) is not charged.
--   sliding_log     ZADD min(extra, requests) entries member:cost+1 .. at at_us, if
--                   member:cost is still there: a window already full of the request's
--                   entries admits nothing more until they leave, so entries past the
--                   limit would change no decision.
--   weighted_log    the entry member#cost becomes member#keep at the same score.
--   calendar        INCRBY extra, if the period's key exists.
--   the others      nothing (a token budget, the only caller that charges, runs on the
--                   algorithms that settle exactly: the table's `settles_exactly`).
--
-- Every key keeps an expiry: a key written here exists already and keeps its TTL (ZADD,
-- INCRBY, DECRBY and HSET leave it; SET is given PX). A renamed weighted_log entry is added
-- before the old one is removed, since Redis deletes an emptied sorted set, TTL and all, and
-- a key re-created by the ZADD would never expire.

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
    held = charge(algorithm, key, requests, -back, keep + back, member, at)
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
