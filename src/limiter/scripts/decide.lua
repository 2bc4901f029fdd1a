-- The driver: every limit of one request, of any mix of algorithms, decided atomically.
-- Concatenated after sliding_log.lua, weighted_log.lua, sliding_window.lua, fixed_window.lua,
-- gcra.lua and calendar.lua at compile time (see src/limiter/redis/scripts.rs), whose check
-- and record functions it calls.
--
-- KEYS[i]      one key per limit, of the type its algorithm keeps
-- ARGV[1]      a member name unique to this request (instance id and sequence number), so
--              two requests admitted in the same microsecond never collapse into one entry
-- ARGV[7i-5..7i+1]  the limit of KEYS[i]: algorithm (sliding_log | weighted_log |
--              sliding_window | fixed_window | gcra | calendar), requests, window in
--              microseconds (for a calendar quota: the time left in its period), burst, cost,
--              shadow (1: the limit is counted but never rejects), max delay in microseconds
--              (`on_exceed: delay`; 0: a limit without room rejects)
--
-- Returns {admitted, retry_after_us, now_us, at_us, remaining_1, reset_us_1, rejecting_1,
--          remaining_2, ...}
--   admitted        1 if the request was admitted and recorded under every key, 0 if it was
--                   rejected and recorded under none
--   retry_after_us  for a rejection, the time until every rejecting limit admits it
--   now_us          the Redis TIME the decision was made at
--   at_us           for an admission, when it is recorded in the exact algorithms: now_us,
--                   or later for a request delayed by a limit with a max delay (the longest
--                   wait among those limits; every other limit must admit it now)
--   remaining_i     requests (of cost 1) KEYS[i] would still admit now
--   reset_us_i      time until KEYS[i] admits one more than now (0 when it holds nothing)
--   rejecting_i     1 if KEYS[i] had no room for the request (for a shadow limit: would have
--                   rejected it), else 0
--
-- Every key is checked before any is recorded: a rejection records nothing anywhere. A
-- shadow limit without room neither rejects the request nor records it in itself. A delayed
-- request is recorded at at_us in sliding_log and gcra (see sliding_log.rs for why the log
-- stays exact), at now in the counters. The clock is Redis TIME, so gateways with skewed
-- clocks still agree.

local algorithms = {
  sliding_log = {check = sliding_log_check, record = sliding_log_record},
  weighted_log = {check = weighted_log_check, record = weighted_log_record},
  sliding_window = {check = sliding_window_check, record = sliding_window_record},
  fixed_window = {check = fixed_window_check, record = fixed_window_record},
  gcra = {check = gcra_check, record = gcra_record},
  calendar = {check = calendar_check, record = calendar_record},
}

-- Whether some limit of the request may delay it: sliding_log keys may then hold future
-- entries, which their expiry must cover.
local delays = false
for i = 1, #KEYS do
  if tonumber(ARGV[7 * i + 1]) > 0 then
    delays = true
  end
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local limits, states = {}, {}
local admitted = 1
local retry_after = 0
local delay = 0

for i = 1, #KEYS do
  local base = 7 * i - 5
  local limit = {
    algorithm = algorithms[ARGV[base]],
    requests = tonumber(ARGV[base + 1]),
    window = tonumber(ARGV[base + 2]),
    burst = tonumber(ARGV[base + 3]),
    cost = tonumber(ARGV[base + 4]),
    shadow = ARGV[base + 5] == '1',
    max_delay = tonumber(ARGV[base + 6]),
    delays = delays,
  }
  if not limit.algorithm then
    return redis.error_reply('unknown algorithm ' .. tostring(ARGV[base]))
  end
  limits[i] = limit
  states[i] = limit.algorithm.check(KEYS[i], now, limit)
  if not states[i].ok and not limit.shadow then
    if states[i].wait <= limit.max_delay then
      delay = math.max(delay, states[i].wait)
    else
      admitted = 0
    end
    retry_after = math.max(retry_after, states[i].wait)
  end
end

if admitted == 1 then
  retry_after = 0
end
local at = now + delay
local result = {admitted, retry_after, now, at}
for i = 1, #KEYS do
  local remaining, reset = states[i].remaining, states[i].reset
  -- Recorded: every limit with room, and every limit that delays the request.
  if admitted == 1 and (states[i].ok or not limits[i].shadow) then
    remaining, reset = limits[i].algorithm.record(KEYS[i], now, limits[i], states[i], ARGV[1], at)
  end
  result[#result + 1] = remaining
  result[#result + 1] = reset
  result[#result + 1] = states[i].ok and 0 or 1
end
return result
