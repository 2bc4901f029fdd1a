-- Fixed window: one counter per limit, whose expiry is set by the first hit of its window.
-- Part of decide.lua (concatenated at compile time, after prelude.lua, whose floor, ceil and
-- format it uses).
--
-- KEYS       the limit's counter (a string holding an integer); absent = an empty window.
-- limit      requests, window (us), burst (unused), cost
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the count
--            and the time left in the window (us); record: remaining, reset_us
--
-- The window starts at the first hit, so up to twice `requests` can pass within one window's
-- length across a boundary (a full window ending, a new one starting at once).

local function fixed_window_check(key, now, requests, window, burst, cost)
  local count, ttl = 0, 0
  local stored = redis.call('GET', key)
  if stored then
    count = tonumber(stored)
  end
  if count > 0 then
    ttl = redis.call('PTTL', key)
    if ttl < 0 then
      ttl = 0
    end
    ttl = ttl * 1000
  end
  local remaining = requests - count
  if remaining < 0 then
    remaining = 0
  end
  if count + cost > requests then
    return false, ttl, remaining, ttl, count, ttl
  end
  return true, 0, remaining, ttl, count, ttl
end

-- `cost_arg`: the cost as sent (ARGV), which is how INCRBY would print it anyway.
local function fixed_window_record(key, now, requests, window, burst, cost, count, ttl,
                                   member, at, delays, cost_arg)
  local new = count + cost
  if count == 0 then
    ttl = ceil(window / 1000) * 1000
    redis.call('SET', key, format('%d', new), 'PX',
               format('%d', ttl / 1000))
  else
    redis.call('INCRBY', key, cost_arg)
  end
  local remaining = requests - new
  if remaining < 0 then
    remaining = 0
  end
  return remaining, ttl
end

-- Gives back `back` (release.lua): DECRBY, only if the key exists; at zero the key goes (the
-- next hit starts a window, as for a fresh key). If the request's window ended in between,
-- the give-back lands in the new window: at most `back` more, within the algorithm's
-- documented twice the limit across a boundary.
local function fixed_window_release(key, now, requests, window, back)
  return counter_give_back(key, back)
end
