-- Release: settles what one admitted request recorded under some of its limits to the part it
-- keeps, so each stands as if the request had been admitted with the kept cost only (as
-- exactly as its algorithm allows). Used for a held request whose client left
-- (`on_exceed: delay`), for an outcome a `count:` limit does not count, to undo the admitted
-- part of a request decided in several calls (all three keep nothing), and to settle a
-- reservation to what the response says it used (a token budget keeps its usage, which may
-- be more than it reserved: an overrun, charged here). A script of its own (not part of
-- decide.lua); it needs no helper of the algorithms' files.
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
-- Per algorithm, with `back` = cost - keep units given back:
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
--
-- An overrun (keep > cost, `extra` = keep - cost units more than recorded) is charged where
-- the request is still recorded, at the time it was recorded, so the window makes its
-- identity wait for what it really spent (this can take a limit past `requests`: the units
-- were spent upstream already). A request no longer there (reset by the admin API, left its
-- window or period) is not charged.
--   sliding_log     ZADD min(extra, requests) entries member:cost+1 .. at at_us, if
--                   member:cost is still there: a window already full of the request's
--                   entries admits nothing more until they leave, so entries past the
--                   limit would change no decision.
--   weighted_log    the entry member#cost becomes member#keep at the same score.
--   calendar        INCRBY extra, if the period's key exists.
--   gcra, fixed_window, sliding_window   nothing (a token budget, the only caller that
--                   charges, runs on the three exact algorithms above: `llm::settles_exactly`).
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

-- Renames the weighted_log entry of a request recorded with weight `cost` to weight `keep`,
-- at the same score (removes it when keep is 0). The new entry goes in before the old one
-- leaves, so the set never empties and keeps its TTL. Whether the entry was there.
local function reweigh(key, member, cost, keep)
  local name = member .. '#' .. cost
  local score = redis.call('ZSCORE', key, name)
  if not score then
    return false
  end
  if keep > 0 then
    redis.call('ZADD', key, score, member .. '#' .. keep)
  end
  redis.call('ZREM', key, name)
  return true
end

-- Charges `extra` units more to a request recorded with `cost` (an overrun), where it is
-- still recorded. Whether anything was charged.
local function charge(key, algorithm, requests, extra, cost, member, at)
  if algorithm == 'weighted_log' then
    return reweigh(key, member, cost, cost + extra)
  elseif algorithm == 'sliding_log' then
    if not redis.call('ZSCORE', key, member .. ':' .. cost) then
      return false
    end
    local score = string.format('%.0f', at)
    local last = cost + math.min(extra, requests)
    local args = {}
    for j = cost + 1, last do
      args[#args + 1] = score
      args[#args + 1] = member .. ':' .. j
      if #args == 1000 or j == last then
        redis.call('ZADD', key, unpack(args))
        args = {}
      end
    end
    return true
  elseif algorithm == 'calendar' then
    if redis.call('EXISTS', key) == 0 then
      return false
    end
    redis.call('INCRBY', key, extra)
    return true
  end
  return false
end

for i = 1, #KEYS do
  local key = KEYS[i]
  local base = 5 * i - 1
  local algorithm = ARGV[base]
  local requests = tonumber(ARGV[base + 1])
  local window = tonumber(ARGV[base + 2])
  local keep = tonumber(ARGV[base + 4])
  local back = tonumber(ARGV[base + 3]) - keep
  if back == 0 then
    -- Everything is kept: nothing to give back or charge.
  elseif back < 0 then
    if charge(key, algorithm, requests, -back, keep + back, member, at) then
      released = released + 1
    end
  elseif algorithm == 'sliding_log' then
    local members, removed = {}, 0
    for j = keep + 1, keep + back do
      members[#members + 1] = member .. ':' .. j
      if #members == 1000 or j == keep + back then
        removed = removed + redis.call('ZREM', key, unpack(members))
        members = {}
      end
    end
    if removed > 0 then
      released = released + 1
    end
  elseif algorithm == 'weighted_log' then
    if reweigh(key, member, keep + back, keep) then
      released = released + 1
    end
  elseif algorithm == 'gcra' then
    local tat = tonumber(redis.call('GET', key) or '0')
    if tat > now then
      local t = math.ceil(window / requests)
      local new = tat - back * t
      if new > now then
        redis.call('SET', key, string.format('%.0f', new), 'PX', math.ceil((new - now) / 1000))
      else
        redis.call('DEL', key)
      end
      released = released + 1
    end
  elseif algorithm == 'fixed_window' or algorithm == 'calendar' then
    local count = tonumber(redis.call('GET', key) or '0')
    if count > 0 then
      if count > back then
        redis.call('DECRBY', key, back)
      else
        redis.call('DEL', key)
      end
      released = released + 1
    end
  elseif algorithm == 'sliding_window' then
    local stored = redis.call('HMGET', key, 'w', 'c', 'p')
    local w = tonumber(stored[1])
    if w then
      local index = math.floor(now / window)
      local counted = math.floor(decided / window)
      local c, p = tonumber(stored[2] or '0'), tonumber(stored[3] or '0')
      -- The stored window may be behind the clock: bring it to now first.
      if w == index - 1 then
        w, c, p = index, 0, c
      elseif w < index - 1 then
        w, c, p = index, 0, 0
      end
      if counted == w and c > 0 then
        redis.call('HSET', key, 'w', w, 'c', math.max(c - back, 0), 'p', p)
        released = released + 1
      elseif counted == w - 1 and p > 0 then
        redis.call('HSET', key, 'w', w, 'c', c, 'p', math.max(p - back, 0))
        released = released + 1
      end
    end
  else
    return redis.error_reply('unknown algorithm ' .. tostring(algorithm))
  end
end
return released
