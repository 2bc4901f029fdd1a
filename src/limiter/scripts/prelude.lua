-- The first part of decide.lua and peek.lua (concatenated at compile time, see
-- src/limiter/redis/scripts.rs): the library functions every algorithm file uses, as locals
-- its functions capture. One set rather than one per file: each local captured is work on
-- every call, since a script's functions are closures made anew each time it runs.
--
-- format('%d', x) is how the algorithms turn an integer into a string for redis.call: an
-- integer conversion, exact below 2^63. Lua's own conversion ('%.14g') would cut a 16-digit
-- microsecond timestamp, and a number handed to redis.call is printed by Redis 7.0 with
-- '%.17g': float formatting, measured at 0.5 us more per SET than a '%d' string.

local floor, ceil, format = math.floor, math.ceil, string.format

-- An identity's override of its limit's number (written by the admin API, see
-- src/limiter/overrides.rs, which spells the same key): beside the counted key, in its Redis
-- Cluster slot, the key up to its hash tag's close and ':o', holding the number. Returns the
-- requests and burst in force (a burst equal to requests, the default burst, follows the
-- override) and the override (0: none).
local function overridden(key, requests, burst)
  local close = string.find(key, '}', 1, true)
  local value = close and redis.call('GET', string.sub(key, 1, close) .. ':o')
  if not value then
    return requests, burst, 0
  end
  local n = tonumber(value)
  if burst == requests then
    burst = n
  end
  return n, burst, n
end

-- Gives back `back` units of a plain counter (a string key INCRBY'd by its algorithm):
-- DECRBY, only if the key exists, so a key that expired is not re-created without an expiry;
-- at zero the key goes. Returns whether the key held something.
local function counter_give_back(key, back)
  local count = tonumber(redis.call('GET', key) or '0')
  if count <= 0 then
    return false
  end
  if count > back then
    redis.call('DECRBY', key, back)
  else
    redis.call('DEL', key)
  end
  return true
end
