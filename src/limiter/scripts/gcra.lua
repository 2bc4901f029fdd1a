-- GCRA (generic cell rate algorithm): a token bucket kept as one number per limit, the
-- theoretical arrival time (TAT). Part of decide.lua (concatenated at compile time,
-- after prelude.lua, whose floor, ceil and format it uses).
--
-- KEYS       the limit's TAT in microseconds on the Redis server's clock (a string); absent
--            = the TAT is now (the bucket is full). It expires when it falls behind the clock.
-- limit      requests, window (us), burst, cost; emission interval T = ceil(window /
--            requests) us, tolerance tau = T * (burst - 1)
-- Returns    check: ok, wait_us, remaining, reset_us, then its state for record: the new
--            TAT and T; record: remaining, reset_us
--
-- Multiple return values rather than tables (each an allocation and GC work), and integers
-- turned into strings with prelude.lua's format('%d'), not float formatting.

-- remaining, reset_us for a TAT `d` us ahead of now.
local function gcra_state(d, t, burst)
  if d <= 0 then
    return burst, 0
  end
  local remaining = floor((burst * t - d) / t)
  if remaining < 0 then
    remaining = 0
  end
  return remaining, d - (burst - remaining - 1) * t
end

local function gcra_check(key, now, requests, window, burst, cost)
  local t = ceil(window / requests)
  local tat = now
  local stored = redis.call('GET', key)
  if stored then
    stored = tonumber(stored)
    if stored > now then
      tat = stored
    end
  end
  local new = tat + cost * t
  local remaining, reset = gcra_state(tat - now, t, burst)
  if new - now > burst * t then
    return false, new - burst * t - now, remaining, reset, new, t
  end
  return true, 0, remaining, reset, new, t
end

-- `at`: now, or the later time a delayed request is forwarded at; the TAT moves to
-- max(TAT, at) + cost * T (see gcra.rs).
local function gcra_record(key, now, requests, window, burst, cost, new, t, member, at)
  local later = at + cost * t
  if later > new then
    new = later
  end
  redis.call('SET', key, format('%d', new), 'PX',
             format('%d', ceil((new - now) / 1000)))
  return gcra_state(new - now, t, burst)
end

-- Gives back `back` (release.lua): TAT -= back * T, never below now (then the key goes: a full
-- bucket). Exact unless the TAT fell behind the clock in between (then up to back * T more
-- than the request's share comes back, once); a request recorded after the TAT (delayed by
-- another limit) left the TAT at its own time, which stays (less comes back).
local function gcra_release(key, now, requests, window, back)
  local tat = tonumber(redis.call('GET', key) or '0')
  if tat <= now then
    return false
  end
  local new = tat - back * ceil(window / requests)
  if new > now then
    redis.call('SET', key, format('%d', new), 'PX', format('%d', ceil((new - now) / 1000)))
  else
    redis.call('DEL', key)
  end
  return true
end
